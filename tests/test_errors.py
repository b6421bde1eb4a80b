"""Bad input, refused clearly: every case raises an ``FxPipeError`` (a user mistake is also a
``ValueError`` or ``TypeError``) whose message names the offending value, and leaves the model
exactly as it was: ``state_dict`` values, parameter and buffer devices and objects, and the
``training`` flag of every submodule (the models and the snapshot: error_models.py). What
looks like bad input but is not: test_not_errors.py; the command line's refusals:
views/test_cli.py.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from error_models import (
    Counter,
    DataDependent,
    Keyed,
    Nothing,
    Outputs,
    Pair,
    Snapshot,
    Steps,
    X,
    net,
    pair_example,
)
from models import ZOO, FixedRows
from torch import nn

import fxpipe
from fxpipe.errors import (
    ConfigError,
    DeviceError,
    FxPipeError,
    InputError,
    PlanError,
    StageRunError,
    TraceError,
)

CPU2 = ["cpu", "cpu"]
CUDA_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0


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
    "example_input a collated dict": Bad(
        net,
        _build(example={"x": X}),
        InputError,
        r"example_input is a dict with keys 'x' .*example_input=\(\), example_kwargs=batch",
    ),
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


def test_the_remedy_for_a_collated_dict_as_example_input_works() -> None:
    """Refused as example_input, the batch passed as example_kwargs builds a pipeline whose
    calls with it (``pipe(**batch)``, as a Trainer makes them) equal the model's."""
    model = net()
    twin = copy.deepcopy(model)
    batch = {"x": X}
    with pytest.raises(InputError, match=r"example_kwargs=batch"):
        fxpipe.pipeline(model, batch, CPU2, cost="flops", chunks=2)
    pipe = fxpipe.pipeline(model, (), CPU2, example_kwargs=batch, cost="flops", chunks=2)
    torch.testing.assert_close(pipe(**batch), twin(**batch))


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
