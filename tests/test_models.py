"""Sanity checks of the shared model zoo itself: builds, runs, is deterministic, traces."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch
import torch.fx
from models import ZOO, Case, cases
from torch import nn

ALL = list(ZOO.values())
KNOWN_TAGS = {
    "batchnorm", "dropout", "tied", "kwargs", "dict_out", "tuple_out", "dataclass_out",
    "inplace", "buffers", "transformer", "shared",
}  # fmt: skip


def tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a model output (tensor, tuple, list, dict or dataclass), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in tensors(v)]
    if dataclasses.is_dataclass(out):
        return [t for f in dataclasses.fields(out) for t in tensors(getattr(out, f.name))]
    return []


def assert_same(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected)
    got, want = tensors(actual), tensors(expected)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def run(case: Case, model: nn.Module, batch: int) -> Any:
    args, kwargs = case.example(batch)
    return model(*args, **kwargs)


def batch_dynamic(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dynamic_shapes`` for torch.export marking dimension 0 of every tensor input."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    auto = torch.export.Dim.AUTO
    return {k: {0: auto} if isinstance(v, torch.Tensor) else None for k, v in bound.items()}


def test_zoo_is_well_formed() -> None:
    assert len(ALL) >= 10
    for name, case in ZOO.items():
        assert name == case.name
        assert case.kind in {"chain", "branchy"}
        assert case.tracer in {"fx", "export"}
        assert case.max_stages >= 4 and case.batch >= 4
        assert case.tags <= KNOWN_TAGS, case.tags - KNOWN_TAGS
    assert cases() == ALL
    assert [c.name for c in cases(tracer="export")] == ["export_only", "llama"]
    assert {c.name for c in cases(tag="tied")} == {"transformer"}
    assert all("batchnorm" in c.tags and c.tracer == "fx" for c in cases(tag="batchnorm"))
    assert {c.kind for c in ALL} == {"chain", "branchy"}


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.name)
def test_eager_forward_backward_at_two_batch_sizes(case: Case) -> None:
    model = case.build().train()
    for batch in (case.batch, 3):
        model.zero_grad()
        outs = tensors(run(case, model, batch))
        assert all(t.shape[0] == batch for t in outs)
        sum(t.square().mean() for t in outs).backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.name)
def test_deterministic_under_seed(case: Case) -> None:
    rng = torch.get_rng_state()
    a, b = case.build(), case.build()
    assert torch.equal(torch.get_rng_state(), rng), "build() must not move the global RNG"
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)
    (args_a, kw_a), (args_b, kw_b) = case.example(case.batch), case.example(case.batch)
    for x, y in zip(tensors([args_a, kw_a]), tensors([args_b, kw_b]), strict=True):
        assert torch.equal(x, y)
    torch.manual_seed(7)
    out_a = run(case, a.train(), case.batch)
    torch.manual_seed(7)
    out_b = run(case, b.train(), case.batch)
    assert_same(out_a, out_b)


@pytest.mark.parametrize("case", cases(tracer="fx"), ids=lambda c: c.name)
def test_fx_trace_matches_eager(case: Case) -> None:
    model = case.build().eval()
    gm = torch.fx.symbolic_trace(model)
    assert 20 <= len(gm.graph.nodes) <= 400
    with torch.no_grad():
        for batch in (case.batch, 3):
            args, kwargs = case.example(batch)
            assert_same(gm(*args, **kwargs), model(*args, **kwargs))


def test_export_only_fails_fx_and_exports_with_dynamic_batch() -> None:
    case = ZOO["export_only"]
    model = case.build().eval()
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model)
    args, kwargs = case.example(case.batch)
    dynamic = batch_dynamic(model, args, kwargs)
    program = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic)
    exported = program.module()
    with torch.no_grad():
        for batch in (case.batch, 3, 1):
            args, kwargs = case.example(batch)
            assert_same(exported(*args, **kwargs), model(*args, **kwargs))


@pytest.mark.slow
def test_tags_describe_the_models() -> None:
    for case in ALL:
        model, (args, kwargs) = case.build(), case.example(case.batch)
        modules = list(model.modules())
        out = model(*args, **kwargs)
        named = list(model.named_parameters(remove_duplicate=False))
        checks = {
            "batchnorm": any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules),
            "dropout": any(isinstance(m, nn.Dropout) and m.p > 0 for m in modules),
            "tied": len(named) > len({id(p) for _, p in named}),
            "kwargs": any(isinstance(v, torch.Tensor) for v in kwargs.values()),
            "dict_out": isinstance(out, dict),
            "tuple_out": isinstance(out, tuple),
            "dataclass_out": dataclasses.is_dataclass(out),
            "buffers": any(
                not isinstance(m, nn.modules.batchnorm._BatchNorm) and list(m.buffers(False))
                for m in modules
            ),
        }
        for tag, holds in checks.items():
            assert holds == (tag in case.tags), (case.name, tag)


def test_graph_features_behind_tags() -> None:
    shared = torch.fx.symbolic_trace(ZOO["shared_module"].build())
    targets = [n.target for n in shared.graph.nodes if n.op == "call_module"]
    assert targets.count("shared.fc1") == 2
    inplace = torch.fx.symbolic_trace(ZOO["bn_dropout_buffers"].build())
    assert any(n.op == "call_method" and n.target == "relu_" for n in inplace.graph.nodes)
    gpt = ZOO["transformer"].build()
    assert gpt.head.weight is gpt.tok.weight
    assert "pos_ids" not in gpt.state_dict() and "causal" in gpt.state_dict()
