"""Tracing: the flat traced graph computes what the eager model computes, and tracing leaves
the model as it was."""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import pytest
import torch
import torch.fx as fx
from models import ZOO, Case, cases
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.errors import FxPipeError, InputError, TraceError
from fxpipe.trace.tracing import trace

ALL = list(ZOO.values())
FX_CASES = cases(tracer="fx")


pytestmark = pytest.mark.usefixtures("one_thread")


def traced_output(t: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    flat = t.graph_module(*t.binder.bind(args, kwargs))
    return tree_unflatten(list(flat), t.output_spec)


def assert_same_tree(actual: Any, expected: Any) -> None:
    got, got_spec = tree_flatten(actual)
    want, want_spec = tree_flatten(expected)
    assert type(actual) is type(expected)
    assert got_spec == want_spec
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


#: Cases export is also tried on: those with a feature (tags) and the export-only one.
EXPORT_CASES = [c for c in ALL if c.tags or c.tracer == "export"]


def tracer_params() -> list[Any]:
    """(case, tracer): every case with its own tracer, export on EXPORT_CASES, and auto on
    one case of each tracer."""
    pairs = [(c, c.tracer) for c in ALL]
    pairs += [(c, "export") for c in EXPORT_CASES if c.tracer != "export"]
    pairs += [(ZOO["mlp_residual"], "auto"), (ZOO["export_only"], "auto")]
    return [pytest.param(case, tracer, id=f"{case.name}-{tracer}") for case, tracer in pairs]


@functools.cache
def traced(name: str, tracer: str) -> tuple[nn.Module, Any]:
    """The zoo model ``name`` in eval mode and its trace (built once per module)."""
    case = ZOO[name]
    model = case.build().eval()
    args, kwargs = case.example(case.batch)
    return model, trace(model, args, kwargs, tracer=tracer)


@pytest.mark.parametrize("case, tracer", tracer_params())
def test_traced_graph_equals_eager_in_eval_mode(case: Case, tracer: str) -> None:
    model, t = traced(case.name, tracer)
    args, kwargs = case.example(case.batch)
    assert t.tracer == (case.tracer if tracer == "auto" else tracer)
    assert isinstance(t.graph_module, fx.GraphModule)
    placeholders = [n for n in t.graph_module.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(t.example_values)
    with torch.no_grad():
        expected = model(*args, **kwargs)
        flat = t.graph_module(*t.example_values)
        assert isinstance(flat, tuple)
        assert all(isinstance(x, torch.Tensor) for x in flat)
        assert [x.shape for x in flat] == [x.shape for x in tree_flatten(expected)[0]]
        assert_same_tree(traced_output(t, args, kwargs), expected)
        # a different batch size goes through the same graph
        args3, kwargs3 = case.example(3)
        assert_same_tree(traced_output(t, args3, kwargs3), model(*args3, **kwargs3))


@pytest.mark.parametrize("case", FX_CASES, ids=lambda c: c.name)
def test_output_spec_matches_eager_structure(case: Case) -> None:
    model, t = traced(case.name, "fx")
    args, kwargs = case.example(case.batch)
    with torch.no_grad():
        _, spec = tree_flatten(model(*args, **kwargs))
    assert t.output_spec == spec


class NestedOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        return {"a": [h, h + 1], "b": (h * 2, {"c": h - 1})}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_nested_containers_come_back_as_the_users_types(tracer: str) -> None:
    model = NestedOutput().eval()
    x = torch.randn(3, 4)
    t = trace(model, (x,), tracer=tracer)
    with torch.no_grad():
        got, want = traced_output(t, (x,), {}), model(x)
    assert_same_tree(got, want)
    assert type(got["a"]) is list and type(got["b"][1]) is dict


def test_auto_falls_back_to_export_only_when_fx_fails() -> None:
    case = ZOO["export_only"]
    model, t = traced(case.name, "auto")
    args, kwargs = case.example(case.batch)
    with pytest.raises(TraceError):
        trace(model, args, kwargs, tracer="fx")
    assert t.tracer == "export"
    with torch.no_grad():
        assert_same_tree(traced_output(t, args, kwargs), model(*args, **kwargs))
    assert traced("mlp_residual", "auto")[1].tracer == "fx"


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_keyword_arguments_bind_by_name_or_position(tracer: str) -> None:
    case = ZOO["transformer"]
    model, t = traced(case.name, tracer)
    (idx,), kwargs = case.example(case.batch)
    mask = kwargs["attention_mask"]
    by_name = t.binder.bind((idx,), {"attention_mask": mask})
    by_position = t.binder.bind((idx, mask), {})
    assert len(by_name) == len(by_position) == len(t.example_values)
    assert all(a is b for a, b in zip(by_name, by_position, strict=True))
    assert any(v is mask for v in by_name)
    with torch.no_grad():
        want = model(idx, attention_mask=mask)
        assert torch.equal(t.graph_module(*by_position)[0], want)
        # the mask matters: a different mask gives a different output, as in eager
        other = torch.ones_like(mask)
        got = tree_unflatten(list(t.graph_module(*t.binder.bind((idx, other), {}))), t.output_spec)
        assert torch.equal(got, model(idx, attention_mask=other))
        assert not torch.equal(got, want)


class ConstantArgs(nn.Module):
    """A loop count, a scale and a mode string traced as constants; a keyword-only mask."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(
        self,
        x: torch.Tensor,
        num_steps: int = 2,
        *,
        scale: float = 1.5,
        mode: str = "add",
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.lin(x) * scale
        for _ in range(num_steps):
            h = torch.tanh(h) + (1.0 if mode == "add" else -1.0)
        if mask is not None:
            h = h * mask
        return h


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_constant_arguments_are_traced_in(tracer: str) -> None:
    model = ConstantArgs().eval()
    x, mask = torch.randn(3, 4), torch.rand(3, 4)
    kwargs = {"scale": 2.0, "mode": "sub", "mask": mask}
    t = trace(model, (x, 3), kwargs, tracer=tracer)
    placeholders = [n for n in t.graph_module.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 2  # x and mask; the constants are not graph inputs
    with torch.no_grad():
        assert torch.equal(traced_output(t, (x, 3), kwargs), model(x, 3, **kwargs))
        assert torch.equal(
            traced_output(t, (x,), {"num_steps": 3, **kwargs}), model(x, 3, **kwargs)
        )
        # other tensors, same constants: still the eager result
        x2 = torch.randn(5, 4)
        kw2 = {**kwargs, "mask": torch.rand(5, 4)}
        assert torch.equal(traced_output(t, (x2, 3), kw2), model(x2, 3, **kw2))


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize(
    "name, args, kwargs",
    [
        ("scale", (3,), {"scale": 1.0, "mode": "sub"}),
        ("mode", (3,), {"scale": 2.0, "mode": "add"}),
        ("mask", (3,), {"scale": 2.0, "mode": "sub", "mask": None}),
        ("num_steps", (2,), {"scale": 2.0, "mode": "sub"}),
    ],
)
def test_a_changed_constant_raises_input_error_naming_it(
    tracer: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    model = ConstantArgs().eval()
    x, mask = torch.randn(3, 4), torch.rand(3, 4)
    t = trace(model, (x, 3), {"scale": 2.0, "mode": "sub", "mask": mask}, tracer=tracer)
    call_kwargs = {"mask": mask, **kwargs}
    with pytest.raises(InputError) as info:
        t.binder.bind((x, *args), call_kwargs)
    assert isinstance(info.value, FxPipeError) and isinstance(info.value, ValueError)
    assert re.search(rf"\b{name}\b", str(info.value)), str(info.value)


class DataDependent(nn.Module):
    """Branches on a tensor's value: neither fx nor export can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return -x


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), DataDependent())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _branch_line() -> int:
    lines, start = inspect.getsourcelines(DataDependent.forward)
    return start + next(i for i, line in enumerate(lines) if "x.sum() > 0" in line)


@pytest.mark.parametrize("tracer", ["auto", "fx", "export"])
def test_untraceable_model_raises_trace_error_naming_module_and_line(tracer: str) -> None:
    model = Outer().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TraceError) as info:
        trace(model, (torch.randn(3, 4),), tracer=tracer)
    error = info.value
    assert isinstance(error, FxPipeError) and isinstance(error, TypeError)
    message = str(error)
    assert "body.1" in message
    assert f"{__file__.rsplit('/', 1)[-1]}:{_branch_line()}" in message
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


STATE_PARAMS = (
    [pytest.param(c, "auto", True, id=f"{c.name}-auto-train") for c in ALL]
    + [
        pytest.param(ZOO[name], "export", True, id=f"{name}-export-train")
        for name in ("bn_dropout_buffers", "transformer", "resnet")
    ]
    + [
        pytest.param(
            ZOO["bn_dropout_buffers"], "export", False, id="bn_dropout_buffers-export-eval"
        )
    ]
)


@pytest.mark.parametrize("case, tracer, training", STATE_PARAMS)
def test_tracing_leaves_the_model_unchanged(case: Case, tracer: str, training: bool) -> None:
    model = case.build().train(training)
    # mixed flags: the first child in the other mode
    model.get_submodule(next(n for n, _ in model.named_children())).train(not training)
    args, kwargs = case.example(case.batch)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = [(p, p.detach().clone(), p.requires_grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    modules = list(model.named_modules(remove_duplicate=False))
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    trace(model, args, kwargs, tracer=tracer)
    assert torch.equal(torch.get_rng_state(), rng)
    assert list(model.state_dict()) == list(state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert all(torch.equal(p, v) and p.requires_grad == r for p, v, r in params)
    assert all(p.grad is None for p, _, _ in params)
    assert [(m, m.training) for m in model.modules()] == modes
    assert list(model.named_modules(remove_duplicate=False)) == modules


def _tied_get_attrs(gm: fx.GraphModule, weight: torch.Tensor) -> list[fx.Node]:
    found = []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value: Any = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        if value is weight:
            found.append(node)
    return found


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_tied_weight_is_one_get_attr_read_twice(tracer: str) -> None:
    model, t = traced("transformer", tracer)
    gm = t.graph_module
    weight = model.tok.weight
    nodes = _tied_get_attrs(gm, weight)
    assert len(nodes) == 1
    assert len(nodes[0].users) == 2
    # no module call hides another copy of it
    for node in gm.graph.nodes:
        if node.op == "call_module":
            held = gm.get_submodule(str(node.target)).parameters()
            assert all(p is not weight for p in held), node.name
    # the graph holds the user's Parameter objects, not copies
    mine = {id(p) for p in model.parameters()}
    assert {id(p) for p in gm.parameters()} <= mine


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_weight_read_in_its_modules_call_and_directly_is_one_get_attr(tracer: str) -> None:
    """``self.first(x)`` and later ``.to(self.first.weight.dtype)``: no module call hides a
    second holder of the weight, which would put it in two stages."""
    model, t = traced("weight_for_dtype", tracer)
    gm = t.graph_module
    weight = model.first.weight
    assert len(_tied_get_attrs(gm, weight)) == 1
    for node in gm.graph.nodes:
        if node.op == "call_module":
            held = gm.get_submodule(str(node.target)).parameters()
            assert all(p is not weight for p in held), node.name


class VarKeyword(nn.Module):
    """``forward(x, **kwargs)``, as many Hugging Face models are written."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * kwargs["scale"]


class VarPositional(nn.Module):
    """``forward(*inputs)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.lin(inputs[0]) + inputs[1]


def variadic_params() -> list[Any]:
    out = []
    for model_type in (VarKeyword, VarPositional):
        for tracer in ("auto", "fx", "export"):
            name = f"{model_type.__name__}-{tracer}"
            out.append(pytest.param(model_type, tracer, id=name))
    return out


@pytest.mark.parametrize("model_type, tracer", variadic_params())
def test_variadic_forward_traces_to_a_callable_graph(
    tracer: str, model_type: type[nn.Module]
) -> None:
    model = model_type().eval()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    args, kwargs = ((x,), {"scale": y}) if model_type is VarKeyword else ((x, y), {})
    t = trace(model, args, kwargs, tracer=tracer)
    with torch.no_grad():
        assert torch.equal(t.graph_module(*t.example_values)[0], model(*args, **kwargs))
        assert torch.equal(traced_output(t, args, kwargs), model(*args, **kwargs))


def test_export_graph_rejects_a_non_batch_size_the_model_fixes() -> None:
    case = ZOO["export_only"]  # checks its feature count, loops over windows of its steps
    model, t = traced(case.name, "export")
    assert t.binder.shape_specialized
    (x,), _ = case.example(case.batch)
    wider = torch.randn(case.batch, x.shape[1], x.shape[2] + 2)  # a feature count it checks
    with pytest.raises(InputError, match="fixed dim 2") as info:
        t.binder.bind((wider,), {})
    assert str(tuple(wider.shape)) in str(info.value)
    # Its loop over windows of 4 steps unrolled for 10 steps holds for 9 to 11 steps only.
    for steps in (8, 12, 14):
        longer = torch.randn(case.batch, steps, x.shape[2])
        with pytest.raises(InputError, match="break a condition") as info:
            t.binder.bind((longer,), {})
        assert str(tuple(longer.shape)) in str(info.value)
    t.binder.bind((x[:3],), {})  # another batch size is fine
    t.binder.bind((x[:, :9],), {})  # and a length the same graph holds for
    with torch.no_grad():
        got = traced_output(t, (x[:, :9],), {})
        assert_same_tree(got, model(x[:, :9]))


def test_export_graph_takes_other_sizes_of_dims_the_model_leaves_free() -> None:
    case = ZOO["llama"]  # a decoder: any sequence length
    model, t = traced(case.name, "export")
    assert not t.binder.shape_specialized
    (ids,), _ = case.example(case.batch)
    for length in (ids.shape[1] - 3, ids.shape[1] + 5):
        other = torch.randint(0, 64, (3, length))
        mask = torch.ones(3, length)
        mask[0, -2:] = 0
        with torch.no_grad():
            assert_same_tree(traced_output(t, (other, mask), {}), model(other, mask))
