"""The plan in torch's ``parallelize_module`` form: the styles of transformers' Llama, what
GPT-2's Conv1D and a fused q, k, v leave out (with their whole group), a tied weight; and, on
two gloo ranks, Llama cut by torch's own tensor parallelism from the found plan gives
eager's logits and gradients."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fxpipe.passes.tensor.plan import tensor_plan
from fxpipe.passes.tensor.torch_plan import torch_plan
from fxpipe.trace.tracing import trace
from tests.distributed.ranks import launch, preload, results
from tests.passes.tensor.test_plan import MODELS, VOCAB, planned

pytest.importorskip("transformers")

preload(__name__)


def test_llama_gets_a_style_for_every_linear_and_its_embedding() -> None:
    p = planned("llama")
    plan = torch_plan(p.plan, p.model)
    assert not plan.missing
    # its norms are cut along the sequence, which these styles leave whole, and say so
    assert len(plan.notes) == 1 and "cut along the sequence" in plan.notes[0]
    without = dataclasses.replace(p.plan, sequence={}, sequence_gathers={})
    assert not torch_plan(without, p.model).notes
    kinds = {path: type(style) for path, style in plan.styles.items()}
    for layer in ("model.layers.0", "model.layers.1"):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            assert kinds[f"{layer}.{name}"] is ColwiseParallel
        assert kinds[f"{layer}.self_attn.o_proj"] is RowwiseParallel
        assert kinds[f"{layer}.mlp.down_proj"] is RowwiseParallel
    assert kinds["model.embed_tokens"] is RowwiseParallel  # rows of an nn.Embedding
    assert "output_layouts=(Replicate(),)" in repr(plan.styles["lm_head"])  # logits gathered
    assert len(plan.styles) == 2 * 7 + 2


def test_gpt2_conv1d_and_fused_qkv_have_no_torch_style() -> None:
    p = planned("gpt2")
    plan = torch_plan(p.plan, p.model)
    assert set(plan.styles) == {"lm_head", "transformer.wte"}  # the tied head and embedding
    fc = plan.missing["transformer.h.0.mlp.c_fc.weight"]
    assert "(Conv1D) (its weight stored (in, out)), not an nn.Linear" in fc
    assert "cut in 3 parts" in plan.missing["transformer.h.1.attn.c_attn.weight"]
    assert plan.notes[0] == (
        "transformer.wte and lm_head share lm_head.weight: parallelize_module gives each its "
        "own parameter; tie them again after it (each is cut along dim 0)"
    )
    assert len(plan.notes) == 2 and "cut along the sequence" in plan.notes[1]


def test_a_group_with_one_inexpressible_member_is_left_out_whole() -> None:
    p = planned("toy")
    plan = torch_plan(p.plan, p.model)
    assert "cut in 3 parts" in plan.missing["blocks.0.attn.qkv.weight"]
    assert plan.missing["blocks.0.attn.proj.weight"].startswith("its group stays whole")
    assert "blocks.0.attn.proj" not in plan.styles
    assert {"blocks.0.mlp.fc1", "blocks.0.mlp.fc2", "head", "tok"} <= set(plan.styles)


def _llama_by_torch(rank: int, world: int) -> dict[str, Any]:
    """Llama cut by ``parallelize_module`` from the found plan; logits and every gradient
    (gathered whole) against the eager model's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, reference = MODELS["llama"](), MODELS["llama"]()
        ids = torch.randint(0, VOCAB, (2, 8))
    reference.load_state_dict(model.state_dict())
    traced = trace(model, (ids,))
    plan = torch_plan(tensor_plan(traced.graph_module, world, (ids,)), model)
    parallelize_module(model, init_device_mesh("cpu", (world,)), dict(plan.styles))
    got, want = model(ids).logits, reference(ids).logits
    weights = torch.linspace(-1.0, 1.0, want.numel()).reshape(want.shape)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    errors = {"logits": _relative(got, want)}
    grads = dict(reference.named_parameters())
    cut = 0
    for name, param in model.named_parameters():
        assert param.grad is not None
        grad = param.grad
        if isinstance(grad, DTensor):
            cut += 1
            grad = grad.full_tensor()
        errors[name] = _relative(grad, grads[name].grad)  # type: ignore[arg-type]
    return {"errors": errors, "cut": cut}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def test_llama_cut_by_torch_from_the_found_plan_equals_eager(tmp_path: Path) -> None:
    for res in results(launch(_llama_by_torch, 2, tmp_path)):
        assert res["cut"] == 2 * 7 + 2  # every product and the embedding; norms whole
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst
