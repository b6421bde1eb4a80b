"""Bad input, refused clearly: every case raises an ``FxPipeError`` (a user mistake is also a
``ValueError`` or ``TypeError``) whose message names the offending value, and leaves the model
exactly as it was: ``state_dict`` values, parameter and buffer devices and objects, and the
``training`` flag of every submodule. Then what looks like bad input but is not: batches
smaller than ``chunks``, in-place writes next to stage borders, outputs that are not all
tensors, frozen parameters; these must equal eager.

The models use mixed training flags (the model in train mode, one submodule in eval), so a
``train()`` or ``eval()`` that is not undone shows.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import sweep
from models import ZOO, FixedRows
from torch import nn
from torch.utils._pytree import tree_flatten

import fxpipe
from fxpipe.api import compile_model
from fxpipe.errors import (
    ConfigError,
    DeviceError,
    FxPipeError,
    InputError,
    PlanError,
    StageRunError,
    TraceError,
)
from fxpipe.options import PlanOptions, RunOptions
from fxpipe.views import cli

CPU2 = ["cpu", "cpu"]
CUDA_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0

# ------------------------------------------------------------------------------- models


class Net(nn.Module):
    """Three blocks with a skip from the first to the head; ``blocks[1]`` is left in eval."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0)) for _ in range(3)
        )
        self.head = nn.Linear(8, 2)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.tanh(self.inp(x))
        h = h0
        for block in self.blocks:
            h = h + torch.tanh(block(h)) * self.scale
        return self.head(h + h0)


def net() -> Net:
    torch.manual_seed(0)
    model = Net()
    model.train()
    model.blocks[1].eval()
    return model


X = torch.randn(6, 4)


class Gate(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.sum() > 0:  # a Python branch on a tensor's value
            return h
        return -h


class DataDependent(nn.Module):
    """Data-dependent Python control flow inside a submodule: no tracer can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(self.fc(x)))


class Counter(Net):
    """Counts its calls in a buffer with a plain tensor op (fx runs it once, at trace time)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return super().forward(x)


class Pair(nn.Module):
    """Two tensor inputs and a keyword-only scale."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.a(x)) + self.b(y) * scale)


def pair_example(batch: int = 6) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x, y, s = (torch.randn(batch, 4, generator=g) for _ in range(3))
    return (x, y), {"scale": s}


class Steps(nn.Module):
    """A non-tensor argument that is fixed at trace time."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, num_steps: int = 2) -> torch.Tensor:
        for _ in range(num_steps):
            x = torch.tanh(self.fc(x))
        return self.out(x)


class Outputs(nn.Module):
    """Returns ``what(h)`` next to a tensor, for outputs that are not per-sample tensors."""

    def __init__(self, what: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.what = what

    def forward(self, x: torch.Tensor) -> Any:
        h = self.b(torch.tanh(self.a(x)))
        return h, self.what(h)


class Nothing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> str:
        return "nothing computed"


class Keyed(nn.Module):
    """Takes one dict argument."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.b(torch.tanh(self.a(batch["x"])) * batch["scale"])


def _keyed_call(model: nn.Module) -> Any:
    pipe = fxpipe.pipeline(model, ({"x": X, "scale": X},), CPU2, cost="flops", chunks=2)
    return pipe({"x": X})


def export_only() -> nn.Module:
    model = ZOO["export_only"].build()
    model.train()
    return model


# ------------------------------------------------------------------------ the catalogue


@dataclass(frozen=True)
class Bad:
    """One bad input: the model, what to do with it, and the error it must raise."""

    build: Callable[[], nn.Module]
    act: Callable[[nn.Module], Any]
    error: type[Exception]
    message: str
    #: False for torch's own errors (load_state_dict), which fxpipe passes on unchanged.
    ours: bool = True


def _pipe(model: nn.Module, **kwargs: Any) -> Callable[[nn.Module], Any]:
    """``fxpipe.pipeline(model, X, ...)`` with the defaults of these tests."""
    options: dict[str, Any] = {"cost": "flops", "chunks": 2, **kwargs}
    devices = options.pop("devices", CPU2)
    example = options.pop("example", X)
    return fxpipe.pipeline(model, example, devices, **options)


def _build(**kwargs: Any) -> Callable[[nn.Module], Any]:
    return lambda model: _pipe(model, **kwargs)


def _call(*args: Any, example: Any = X, **kwargs: Any) -> Callable[[nn.Module], Any]:
    """Build a pipeline on ``example`` (works), then call it with ``args``/``kwargs``."""

    def act(model: nn.Module) -> Any:
        pipe = _pipe(model, example=example)
        return pipe(*args, **kwargs)

    return act


def _pair_call(mutate: Callable[[tuple[Any, ...], dict[str, Any]], Any]) -> Any:
    def act(model: nn.Module) -> Any:
        args, kwargs = pair_example()
        pipe = fxpipe.pipeline(model, args, CPU2, example_kwargs=kwargs, cost="flops", chunks=2)
        return mutate(args, kwargs)(pipe)

    return act


def _export_pipe(model: nn.Module, **options: Any) -> fxpipe.Pipeline:
    args, kwargs = ZOO["export_only"].example(8)
    return fxpipe.pipeline(model, args, CPU2, example_kwargs=kwargs, cost="flops", **options)


def _export_call(model: nn.Module) -> Any:
    args, kwargs = ZOO["export_only"].example(8)
    pipe = _export_pipe(model)
    x = args[0]
    return pipe(torch.randn(x.shape[0], x.shape[1] + 2, x.shape[2]), *args[1:], **kwargs)


def _after_build(edit: Callable[[nn.Module, fxpipe.Pipeline], Any]) -> Any:
    def act(model: nn.Module) -> Any:
        pipe = _pipe(model)
        return edit(model, pipe)

    return act


def _replace_nested(model: nn.Module, pipe: fxpipe.Pipeline) -> Any:
    original = model.blocks[2][0]
    model.blocks[2][0] = nn.Linear(8, 8)
    try:
        return pipe(X)
    finally:
        model.blocks[2][0] = original  # the test's own edit, undone before the check


def _add_module(model: nn.Module, pipe: fxpipe.Pipeline) -> Any:
    model.extra = nn.Linear(2, 2)
    try:
        return pipe(X)
    finally:
        del model.extra


def _missing_key(model: nn.Module, pipe: fxpipe.Pipeline) -> Any:
    state = dict(net().state_dict())
    del state["blocks.1.0.weight"]
    return pipe.load_state_dict(state)


def _unexpected_key(model: nn.Module, pipe: fxpipe.Pipeline) -> Any:
    state = dict(net().state_dict())
    state["blocks.9.weight"] = torch.zeros(1)
    return pipe.load_state_dict(state)


def _cost_of(value: Any) -> Callable[[torch.fx.Node], Any]:
    return lambda node: value


CATALOGUE: dict[str, Bad] = {
    # tracing
    "data-dependent control flow, no tracer": Bad(
        DataDependent, _build(), TraceError, r"(?s)fx: .*'gate'.*export: .*'gate'"
    ),
    "data-dependent control flow, export": Bad(
        DataDependent, _build(tracer="export"), TraceError, r"export: .*'gate'"
    ),
    "buffer written outside the fx graph": Bad(
        Counter, _build(tracer="fx"), TraceError, r"buffer\(s\) 'steps'"
    ),
    "tracer does not exist": Bad(net, _build(tracer="jit"), ConfigError, "tracer='jit'"),
    "tracer None": Bad(net, _build(tracer=None), ConfigError, "tracer=None"),
    "example keyword the model lacks": Bad(
        net, _build(example_kwargs={"mask": X}), InputError, "'mask'"
    ),
    "example misses an argument": Bad(
        Pair, lambda m: fxpipe.plan(m, (X, X), CPU2), InputError, "'scale'"
    ),
    "example without a tensor": Bad(net, _build(example=None), InputError, "no tensor"),
    "example 0-dim tensor": Bad(
        net, _build(example=torch.tensor(1.0)), InputError, r"x is a 0-dim tensor"
    ),
    "example batches disagree": Bad(
        Pair,
        lambda m: fxpipe.plan(m, (X, X[:4]), CPU2, example_kwargs={"scale": X}),
        InputError,
        r"y has batch size 4 \(shape \(4, 4\)\) but x has 6",
    ),
    "example batch empty": Bad(net, _build(example=X[:0]), InputError, "empty"),
    "example is a list of one tensor": Bad(
        net,
        _build(example=[X]),
        InputError,
        r"example_input is a list of 1 item \(a tensor of shape \(6, 4\)\), which the model "
        r"would get as one argument; pass the tensor itself .* a tuple \(x, y\) .*\(\[a, b\],\)",
    ),
    "example is a list of the arguments": Bad(
        Pair,
        lambda m: fxpipe.plan(m, [X, X], CPU2, example_kwargs={"scale": X}),
        InputError,
        r"example_input is a list of 2 items .* a tuple \(x, y\) for several positional",
    ),
    "model is not a module": Bad(net, lambda m: _pipe(m.forward), ConfigError, "method"),
    # planning
    "more stages than cut points": Bad(
        net, _build(devices=["cpu"] * 40), PlanError, r"at most \d+ stages .* 40 stages"
    ),
    "model computes nothing": Bad(Nothing, _build(), PlanError, "computes nothing"),
    "output int grows with the batch but not in proportion": Bad(
        lambda: Outputs(lambda h: h.shape[0] - 1),
        _build(),
        PlanError,
        r"output value output\[1\] \(the graph's 'sub'\) is 5 for a batch of 6 and 6 for 7",
    ),
    "output tensor reduced over the batch by a max": Bad(
        lambda: Outputs(lambda h: h.amax(0)),
        _build(),
        PlanError,
        r"output output\[1\] reduces over the batch through 'amax'.*sums, means and losses",
    ),
    "output picks one sample of the batch": Bad(
        lambda: Outputs(lambda h: h[0]),
        _build(),
        PlanError,
        r"reduces over the batch through 'getitem'",
    ),
    "per-sample values minus the batch mean": Bad(
        lambda: Outputs(lambda h: h - h.mean(0)),
        _build(),
        PlanError,
        r"'sub' .* computes per-sample values from 'mean'.*depends on the whole batch",
    ),
    "per-sample values over the batch size": Bad(
        lambda: Outputs(lambda h: h / h.shape[0]),
        _build(),
        PlanError,
        r"'truediv' .* scales per-sample values by the batch size",
    ),
    "output Python float from item()": Bad(
        lambda: Outputs(lambda h: h.mean().item()), _build(), PlanError, "'item'"
    ),
    "batch size written into the model": Bad(
        FixedRows,
        _build(),
        PlanError,
        r"runs on the example batch of 6 rows but not on its micro-batches of 3 rows "
        r"\(chunks=2\): at reshape\(a, 6, 2, 4\) in forward: shape '\[6, 2, 4\]' is invalid.*"
        r"compute it from the input \(x\.shape\[0\].*or pass chunks=1",
    ),
    "output variance over the batch": Bad(
        lambda: Outputs(lambda h: h.var()),
        _build(),
        PlanError,
        r"reduces over the batch through 'var'",
    ),
    "cost callable returns a str": Bad(
        net, _build(cost=_cost_of("cheap")), ConfigError, "returned 'cheap'"
    ),
    "cost callable returns a negative": Bad(
        net, _build(cost=_cost_of(-1.0)), ConfigError, r"returned -1\.0"
    ),
    "cost mode does not exist": Bad(net, _build(cost="FLOPS"), ConfigError, "cost='FLOPS'"),
    "cost None": Bad(net, _build(cost=None), ConfigError, "cost=None"),
    "slack negative": Bad(net, _build(slack=-0.1), ConfigError, r"slack=-0\.1 must be a number"),
    "slack as text": Bad(net, _build(slack="5%"), ConfigError, "slack='5%' must be a number"),
    "slack not a number": Bad(net, _build(slack=float("nan")), ConfigError, "slack=nan"),
    "deferred_batch_norm on an export-only model": Bad(
        export_only,
        lambda m: _export_pipe(m, deferred_batch_norm=True),
        ConfigError,
        "deferred_batch_norm=True",
    ),
    "deferred_batch_norm not a bool": Bad(
        net, _build(deferred_batch_norm="yes"), ConfigError, "deferred_batch_norm='yes'"
    ),
    # devices and runtime options
    "devices empty": Bad(net, _build(devices=()), DeviceError, r"devices=\[\] is empty"),
    "devices None": Bad(net, _build(devices=None), DeviceError, "devices=None"),
    "devices one comma-separated string": Bad(
        net,
        _build(devices="cpu,cpu"),
        DeviceError,
        r"devices='cpu,cpu' is one string; pass a list with one device per stage: "
        r"\['cpu', 'cpu'\]$",
    ),
    "devices one device": Bad(
        net, _build(devices="cpu"), DeviceError, r"devices='cpu' is one device; .*\['cpu', 'cpu'\]"
    ),
    "devices a count": Bad(
        net,
        _build(devices=2),
        DeviceError,
        r"devices=2 is one CUDA index, not a count; .*\[0, 1\] for the first 2 GPUs, "
        r"or \['cpu'\] \* 2",
    ),
    "CPU with an index": Bad(
        net,
        _build(devices=["cpu", "cpu:5"]),
        DeviceError,
        r"device 'cpu:5' names CPU 5, but the CPU is one device .*write 'cpu'",
    ),
    "CPU with an index, plan()": Bad(
        net, lambda m: fxpipe.plan(m, X, ["cpu:1", "cpu"]), DeviceError, "'cpu:1' names CPU 1"
    ),
    "device string unknown": Bad(net, _build(devices=["cpu", "gpu:0"]), DeviceError, "'gpu:0'"),
    "device None": Bad(net, _build(devices=["cpu", None]), DeviceError, "device None"),
    "CUDA device absent": Bad(
        net,
        _build(devices=["cpu", f"cuda:{CUDA_COUNT}"]),
        DeviceError,
        rf"'cuda:{CUDA_COUNT}' is not present",
    ),
    "CUDA index absent": Bad(
        net, _build(devices=[CUDA_COUNT, CUDA_COUNT]), DeviceError, rf"device {CUDA_COUNT} is"
    ),
    "meta stage for a model with data": Bad(
        net, _build(devices=["cpu", "meta"]), DeviceError, r"'meta'.*'inp.weight' is on cpu"
    ),
    "output device unknown": Bad(net, _build(output_device="nowhere"), DeviceError, "'nowhere'"),
    "chunks negative": Bad(net, _build(chunks=-3), ConfigError, "chunks=-3"),
    "chunks bool": Bad(net, _build(chunks=True), ConfigError, "chunks=True"),
    "chunks float": Bad(net, _build(chunks=4.0), ConfigError, r"chunks=4\.0"),
    "chunks zero": Bad(net, _build(chunks=0), ConfigError, "chunks=0"),
    "checkpoint unknown": Bad(net, _build(checkpoint="Always"), ConfigError, "'Always'"),
    # calls
    "call with a tuple where a tensor was traced": Bad(
        net,
        _call((X,)),
        InputError,
        r"argument x is a tuple of 1 item \(a tensor of shape \(6, 4\)\) but the pipeline "
        r"was traced with a tensor of shape \(batch, 4\) there; pass a tensor",
    ),
    "call with a list where a tensor was traced": Bad(
        net,
        _call([X]),
        InputError,
        r"argument x is a list of 1 item \(a tensor of shape \(6, 4\)\) but .* traced with a "
        r"tensor of shape \(batch, 4\) there; pass a tensor of shape \(batch, 4\) as the "
        r"example did, or rebuild",
    ),
    "call with a dict missing a key": Bad(
        Keyed,
        _keyed_call,
        InputError,
        r"argument batch is a dict with keys \['x'\] but the pipeline was traced with a dict "
        r"with keys \['scale', 'x'\] there",
    ),
    "call with None where a tensor was traced": Bad(
        net, _call(None), InputError, "x is None but a tensor"
    ),
    "call missing a keyword": Bad(
        Pair, _pair_call(lambda a, k: lambda p: p(*a)), InputError, "'scale'"
    ),
    "call with an unknown keyword": Bad(
        Pair,
        _pair_call(lambda a, k: lambda p: p(*a, **k, mask=a[0])),
        InputError,
        "'mask'",
    ),
    "call with too many arguments": Bad(
        Pair,
        _pair_call(lambda a, k: lambda p: p(*a, a[0], **k)),
        InputError,
        "too many positional",
    ),
    "call batch sizes disagree": Bad(
        Pair,
        _pair_call(lambda a, k: lambda p: p(a[0], a[1][:3], **k)),
        InputError,
        r"y has shape \(3, 4\), batch size 3, but x has 6",
    ),
    "call with an empty batch": Bad(
        net, _call(X[:0]), InputError, r"x has an empty batch \(shape \(0, 4\)\)"
    ),
    "call with a 0-dim tensor": Bad(
        net, _call(torch.tensor(2.0)), InputError, "x is a 0-dim tensor"
    ),
    "call export graph with another shape": Bad(
        export_only, _export_call, InputError, r"x \(8, 12, 16\)\) break a condition"
    ),
    "module replaced after pipeline()": Bad(
        net, _after_build(_replace_nested), ConfigError, "changed after pipeline"
    ),
    "module added after pipeline()": Bad(
        net, _after_build(_add_module), ConfigError, "changed after pipeline"
    ),
    "pipe.to('cuda')": Bad(
        net, _after_build(lambda m, p: p.to("cuda")), DeviceError, "cannot move it to cuda"
    ),
    "pipe.to(device=cuda:1)": Bad(
        net,
        _after_build(lambda m, p: p.to(device=torch.device("cuda", 1))),
        DeviceError,
        "cannot move it to cuda:1",
    ),
    "pipe.cuda()": Bad(net, _after_build(lambda m, p: p.cuda()), DeviceError, r"cuda\(\)"),
    "pipe.to('meta')": Bad(
        net, _after_build(lambda m, p: p.to("meta")), DeviceError, "cannot move it to meta"
    ),
    "load_state_dict with assign=True": Bad(
        net,
        _after_build(lambda m, p: p.load_state_dict(net().state_dict(), assign=True)),
        ConfigError,
        "assign=True",
    ),
    "load_state_dict missing a key": Bad(
        net, _after_build(_missing_key), RuntimeError, "blocks.1.0.weight", ours=False
    ),
    "load_state_dict with an unknown key": Bad(
        net, _after_build(_unexpected_key), RuntimeError, "blocks.9.weight", ours=False
    ),
}


@dataclass
class Snapshot:
    """Everything about a model that an error must leave as it was."""

    state: dict[str, torch.Tensor]
    tensors: dict[str, tuple[int, torch.device]]
    training: dict[str, bool]
    modules: dict[str, int]

    @classmethod
    def of(cls, model: nn.Module) -> Snapshot:
        return cls(
            {k: v.detach().clone() for k, v in model.state_dict().items()},
            {k: (id(t), t.device) for k, t in [*model.named_parameters(), *model.named_buffers()]},
            {name: m.training for name, m in model.named_modules()},
            {name: id(m) for name, m in model.named_modules()},
        )

    def assert_same(self, model: nn.Module) -> None:
        state = model.state_dict()
        assert list(state) == list(self.state)
        for key, value in self.state.items():
            assert torch.equal(state[key], value), f"{key} changed"
        tensors = [*model.named_parameters(), *model.named_buffers()]
        assert {k: (id(t), t.device) for k, t in tensors} == self.tensors
        assert {name: m.training for name, m in model.named_modules()} == self.training
        assert {name: id(m) for name, m in model.named_modules()} == self.modules


@pytest.mark.parametrize("case", list(CATALOGUE), ids=list(CATALOGUE))
def test_bad_input_is_refused_clearly_and_leaves_the_model_as_it_was(case: str) -> None:
    bad = CATALOGUE[case]
    model = bad.build()
    before = Snapshot.of(model)
    with pytest.raises(bad.error, match=bad.message) as info:
        bad.act(model)
    if bad.ours:
        assert isinstance(info.value, FxPipeError)
        assert isinstance(info.value, (ValueError, TypeError))
    before.assert_same(model)


def test_the_catalogue_covers_every_area() -> None:
    assert len(CATALOGUE) >= 30
    kinds = {bad.error for bad in CATALOGUE.values()}
    assert {TraceError, PlanError, ConfigError, DeviceError, InputError} <= kinds


@pytest.mark.skipif(CUDA_COUNT > 0, reason="checks the message when no CUDA device exists")
def test_cuda_without_a_gpu_says_so() -> None:
    model = net()
    before = Snapshot.of(model)
    with pytest.raises(DeviceError, match=r"'cuda:0' is not present: this machine has 0 CUDA"):
        _pipe(model, devices=["cuda:0", "cuda:1"])
    before.assert_same(model)


def test_a_call_with_another_non_tensor_value_runs_the_model_traced_for_it() -> None:
    """A loop count is fixed at trace time: a call with another traces the model again
    (a new variant, split along the same borders), never the traced count silently."""
    model = Steps()
    twin = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, (X, 3), CPU2, cost="flops", chunks=2)
    torch.testing.assert_close(pipe(X, 4), twin(X, 4))
    torch.testing.assert_close(pipe(X, 3), twin(X, 3))
    assert len(pipe.variants) == 2
    assert [p.device for p in model.parameters()] == [p.device for p in twin.parameters()]


def test_a_failed_call_leaves_the_pipeline_working() -> None:
    model = net()
    twin = copy.deepcopy(model)
    pipe = _pipe(model)
    for bad in [(X,), None, X[:0], torch.tensor(1.0)]:
        with pytest.raises(InputError):
            pipe(bad)
    torch.testing.assert_close(pipe(X), twin(X))


class Grouped(nn.Module):
    """``reshape(3, -1)`` and back: right only for batches of 12 in 4 micro-batches (3 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.c = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).reshape(3, -1)
        return self.c(h.reshape(-1, 8))


def test_a_shape_error_at_call_time_names_stage_micro_batch_batch_and_the_likely_cause() -> None:
    torch.manual_seed(0)
    model = Grouped()
    x = torch.randn(12, 4)
    pipe = fxpipe.pipeline(model, x, CPU2, cost="flops", chunks=4)
    torch.testing.assert_close(pipe(x), model(x))  # the example's batch size works
    with pytest.raises(RuntimeError) as eager:
        model(x[:2])  # what a micro-batch of 2 rows does to the model itself
    before = Snapshot.of(model)
    with pytest.raises(StageRunError) as info:
        pipe(x[:8])
    error = info.value
    assert isinstance(error, FxPipeError) and isinstance(error, RuntimeError)
    assert type(error.__cause__) is RuntimeError and str(error.__cause__) == str(eager.value)
    j = pipe.plan.stage_of["reshape"]
    modules = " to ".join(m for m in "ac" if pipe.plan.stage_of[m] == j)
    assert str(error).startswith(
        f"stage {j} ({modules}, on cpu) failed on micro-batch 0 of 4 (rows 0-1 of the call's "
        f"batch of 8): {eager.value}. A batch size written into the model"
    )
    assert re.search(r"compute it from the input \(x\.shape\[0\]", str(error))
    assert "chunks=1" in str(error)
    before.assert_same(model)
    torch.testing.assert_close(pipe(x), model(x))  # and the pipeline still works


# ---------------------------------------------------------------- parameters replaced


class Functional(nn.Module):
    """Reads a Parameter and a buffer directly (get_attr), not through a leaf module."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.fc = nn.Linear(4, 4)
        self.register_buffer("shift", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(x @ self.w)) + self.shift


@pytest.mark.parametrize("attribute", ["w", "shift"])
def test_a_parameter_or_buffer_replaced_after_pipeline_is_detected(attribute: str) -> None:
    torch.manual_seed(0)
    model = Functional()
    pipe = fxpipe.pipeline(model, X, CPU2, cost="flops", chunks=2)
    old = getattr(model, attribute)
    new = torch.zeros_like(old)
    setattr(model, attribute, nn.Parameter(new) if attribute == "w" else new)
    with pytest.raises(FxPipeError, match="changed"):
        pipe(X)


# ----------------------------------------------------------------------------- the CLI

FACTORIES = """
import torch
from torch import nn


class Gate(nn.Module):
    def forward(self, h):
        if h.sum() > 0:
            return h
        return -h


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.fc(x))


class Mean(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x), self.fc(x).mean().item()


def untraceable():
    return Untraceable()


def small():
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def mean():
    return Mean()
"""

CLI_CASES = {
    "untraceable model": (["untraceable", "--shape", "4,4"], r"(?s)could not trace .*'gate'"),
    "more devices than cut points": (
        ["small", "--shape", "4,4", "--devices", ",".join(["cpu"] * 9)],
        r"at most \d+ stages",
    ),
    "output read out of a tensor": (["mean", "--shape", "4,4"], "'item'"),
    "keyword inputs not a dict": (
        ["small", "--shape", "4,4", "--kwargs", "[1, 2]"],
        "--kwargs must be a dict",
    ),
    "devices name no device": (["small", "--shape", "4,4", "--devices", " , "], "no device"),
    "run on an absent GPU": (
        ["small", "--shape", "4,4", "--devices", f"cpu,cuda:{CUDA_COUNT}", "--run"],
        "not present",
    ),
}


@pytest.mark.parametrize("case", list(CLI_CASES), ids=list(CLI_CASES))
def test_the_cli_refuses_bad_input_with_exit_2_and_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line turns the same errors into ``error: ...`` and exit status 2."""
    factories = tmp_path / "factories.py"
    factories.write_text(FACTORIES)
    name, *rest = CLI_CASES[case][0]
    code = cli.main(["inspect", f"{factories}:{name}", "--cost", "flops", *rest])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("error: ") and "Traceback" not in err
    assert re.search(CLI_CASES[case][1], err), err


# ------------------------------------------------ not errors: these must equal eager


def assert_equals_eager(
    pipe: fxpipe.Pipeline, model: nn.Module, twin: nn.Module, *args: Any, **kwargs: Any
) -> None:
    """Outputs, and every parameter gradient (float64: to 1e-10), equal the eager twin's."""
    for p in [*model.parameters(), *twin.parameters()]:
        p.grad = None
    got = pipe(*copy.deepcopy(args), **kwargs)
    want = twin(*copy.deepcopy(args), **kwargs)
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    assert got_spec == want_spec
    loss_got, loss_want = (
        torch.zeros((), dtype=torch.float64),
        torch.zeros((), dtype=torch.float64),
    )
    for g, w in zip(got_leaves, want_leaves, strict=True):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
            weights = torch.linspace(-1, 1, w.numel(), dtype=w.dtype).reshape(w.shape)
            loss_got, loss_want = loss_got + (g * weights).sum(), loss_want + (w * weights).sum()
        else:
            assert g == w
    loss_got.backward()
    loss_want.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def _twins(factory: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = factory().double()
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("batch", [1, 3, 7])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_batch_smaller_than_chunks_works_and_equals_eager(batch: int, checkpoint: str) -> None:
    model, twin = _twins(Net)
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 3, chunks=8, checkpoint=checkpoint, cost="flops")
    assert_equals_eager(pipe, model, twin, x[:batch])


def _layers(n: int) -> nn.ModuleList:
    return nn.ModuleList(nn.Linear(6, 6) for _ in range(n))


class ReluUnused(nn.Module):
    """``h.relu_()`` with its result unused; ``h`` is read before and after."""

    def __init__(self) -> None:
        super().__init__()
        self.l = _layers(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l[0](x) + 1
        a = self.l[1](h * 2)
        b = self.l[2](a)
        h.relu_()
        c = self.l[3](b)
        return self.l[5](self.l[4](c) + h)


class AddIntermediate(nn.Module):
    """``h.add_(1)`` on an intermediate a later stage reads."""

    def __init__(self) -> None:
        super().__init__()
        self.l = _layers(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l[0](x) + 1
        b = self.l[2](self.l[1](h * 2))
        h.add_(1)
        c = self.l[3](b)
        return self.l[5](self.l[4](c) * h)


class InplaceReluBeforeResidual(nn.Module):
    """``nn.ReLU(inplace=True)`` on a value a residual reads again later."""

    def __init__(self) -> None:
        super().__init__()
        self.l = _layers(6)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l[1](self.l[0](x)) + 0
        t = self.l[2](h * 1)
        u = self.relu(h)
        w = self.l[4](self.l[3](u)) + h + t
        return self.l[5](w)


class WritesItsInput(nn.Module):
    """Scales its input in place before using it twice (legal: the input needs no grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = _layers(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        g = self.l[1](self.l[0](x))
        return self.l[3](self.l[2](g) + x)


INPLACE = [ReluUnused, AddIntermediate, InplaceReluBeforeResidual, WritesItsInput]


@pytest.mark.parametrize("factory", INPLACE, ids=[f.__name__ for f in INPLACE])
@pytest.mark.parametrize("tracer", sweep(["fx", "export"]))
def test_in_place_writes_next_to_stage_borders_equal_eager(
    factory: Callable[[], nn.Module], tracer: str
) -> None:
    x = torch.randn(8, 6, dtype=torch.float64)
    for stages in (2, 3, 4):
        model, twin = _twins(factory)
        compiled = compile_model(
            model, x.clone(), ["cpu"] * stages, PlanOptions(cost="flops", tracer=tracer)
        )
        for checkpoint in ("always", "never"):
            pipe = compiled.pipeline(model, RunOptions(chunks=4, checkpoint=checkpoint))
            assert_equals_eager(pipe, model, twin, x)


def test_a_written_input_is_copied_so_the_callers_tensor_stays() -> None:
    """The eager model would scale the caller's tensor; the pipeline writes into a copy."""
    model, _ = _twins(WritesItsInput)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = fxpipe.pipeline(model, x.clone(), ["cpu"] * 2, chunks=4, cost="flops")
    kept = x.clone()
    pipe(x)
    assert torch.equal(x, kept)


@pytest.mark.parametrize(
    "what",
    [lambda h: "label", lambda h: h.shape[1], lambda h: (None, 3.5), lambda h: {"n": 2}],
    ids=["str", "width", "none-and-float", "dict"],
)
def test_outputs_that_are_not_tensors_pass_through(what: Callable[[torch.Tensor], Any]) -> None:
    model, twin = _twins(lambda: Outputs(what))
    x = torch.randn(7, 4, dtype=torch.float64)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 2, chunks=3, cost="flops")
    assert_equals_eager(pipe, model, twin, x)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_frozen_parameter_stays_without_gradient_and_the_others_equal_eager(
    checkpoint: str,
) -> None:
    model, twin = _twins(Net)
    for m in (model, twin):
        m.blocks[1][0].weight.requires_grad_(False)
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 3, chunks=4, checkpoint=checkpoint, cost="flops")
    stages = {pipe.plan.stage_of[n] for n in pipe.plan.stage_of if n.startswith("blocks_1")}
    assert len(pipe.plan.stages) == 3 and stages
    assert_equals_eager(pipe, model, twin, x)
    assert model.blocks[1][0].weight.grad is None


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_fully_frozen_model_gives_outputs_without_grad_as_eager(checkpoint: str) -> None:
    model, twin = _twins(Net)
    model.requires_grad_(False)
    twin.requires_grad_(False)
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 3, chunks=4, checkpoint=checkpoint, cost="flops")
    assert not pipe(x).requires_grad and not twin(x).requires_grad
    xg = x.clone().requires_grad_()
    pipe(xg).sum().backward()
    want = x.clone().requires_grad_()
    twin(want).sum().backward()
    torch.testing.assert_close(xg.grad, want.grad)


class BatchNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(self.bn(self.a(x)))))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_recomputing_a_stage_does_not_update_batch_norm_statistics_again(tracer: str) -> None:
    """torch.export turns BatchNorm into plain ops on the running buffers; recomputing a
    checkpointed stage must not apply their update a second time."""
    model, twin = _twins(BatchNormed)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = fxpipe.pipeline(
        model, x, ["cpu"] * 2, chunks=1, checkpoint="always", cost="flops", tracer=tracer
    )
    for _ in range(2):
        assert_equals_eager(pipe, model, twin, x)
    for (name, a), b in zip(model.named_buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
