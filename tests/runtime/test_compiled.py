"""Stages through torch.compile (fxpipe.runtime.compiled): equal to the uncompiled pipeline
and to eager, compiled a bounded number of times, eager with a warning where compiling
fails, and the same errors as without compiling.

Most tests use torch's ``aot_eager`` backend (the whole compile path, dynamo and
AOTAutograd, without inductor's C++ code generation, which takes tens of seconds a graph
here); the inductor test is marked slow."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import CompileWarning, ConfigError, StageRunError
from fxpipe.options import CompileOptions

CPU2 = ["cpu", "cpu"]
FAST = {"backend": "aot_eager"}


class Net(nn.Module):
    """A skip connection over a block, BatchNorm (or LayerNorm) and dropout on the way."""

    def __init__(self, p: float = 0.0, batch_norm: bool = True) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32) if batch_norm else nn.LayerNorm(32)
        self.b = nn.Linear(32, 32)
        self.drop = nn.Dropout(p)
        self.c = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.a(x)))
        return self.c(self.drop(torch.tanh(self.b(h))) + h)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and gradients of one backward of ``(out * w).sum()`` (grads zeroed first)."""
    for p in module.parameters():
        p.grad = None
    out = module(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    owner = module.module if isinstance(module, fxpipe.Pipeline) else module
    return out.detach(), _grads(owner)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_compiled_stages_equal_the_uncompiled_pipeline_and_stop_compiling(
    checkpoint: str,
) -> None:
    # BatchNorm in training sees micro-batches, so the oracle is the uncompiled pipeline
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model)
    x = torch.randn(10, 16)  # chunks=4: micro-batches of 3, 3, 3 and a shorter 1
    pipe = fxpipe.pipeline(model, x, CPU2, chunks=4, checkpoint=checkpoint, compile=FAST)
    reference = fxpipe.pipeline(plain, x, CPU2, chunks=4, checkpoint=checkpoint)
    counts = []
    for _ in range(4):
        x = torch.randn(10, 16)
        out, grads = _step(pipe, x)
        want, want_grads = _step(reference, x)
        torch.testing.assert_close(out, want)
        assert grads.keys() == want_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], want_grads[name], msg=name)
        counts.append([c.graphs for c in pipe.compilation])
        assert all(c.compiled for c in pipe.compilation)
    assert all(n > 0 for n in counts[0])  # every stage compiled
    assert counts[1] == counts[2] == counts[3], counts  # and nothing after the first steps
    for name, buffer in plain.named_buffers():  # running statistics updated as uncompiled
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, msg=name)


def test_compiled_stages_equal_eager_without_batch_statistics() -> None:
    torch.manual_seed(6)
    model = Net(batch_norm=False)
    eager = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, torch.randn(10, 16), CPU2, chunks=4, compile=FAST)
    for rows in (10, 7):
        x = torch.randn(rows, 16)
        out, grads = _step(pipe, x)
        want, want_grads = _step(eager, x)
        torch.testing.assert_close(out, want)
        for name in want_grads:
            torch.testing.assert_close(grads[name], want_grads[name], msg=name)


def test_another_batch_size_and_eval_mode_compile_once_more_not_per_call() -> None:
    torch.manual_seed(1)
    model = Net(p=0.3)
    eager = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, torch.randn(12, 16), CPU2, chunks=4, compile=FAST)
    for rows in (12, 11, 12):  # micro-batches of 3, then of 3 and 2
        _step(pipe, torch.randn(rows, 16))
    trained = sum(c.graphs for c in pipe.compilation)
    trained_first = [c.graphs for c in pipe.compilation]
    for rows in (8, 16, 12):  # other batch sizes: the rows are symbolic from the start
        _step(pipe, torch.randn(rows, 16))
    assert sum(c.graphs for c in pipe.compilation) == trained
    pipe.eval()
    eager.load_state_dict(model.state_dict())  # the running statistics training left
    eager.eval()
    with torch.no_grad():
        for rows in (12, 5, 12, 8):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(pipe(x), eager(x))  # dropout off, running statistics
        evaluated = [c.graphs for c in pipe.compilation]
        for rows in (6, 12):
            pipe(torch.randn(rows, 16))
    # an fx graph whose dropout and BatchNorm are modules follows eval() by itself: the eval
    # variant runs the same stages, whose compiled forwards compile eval graphs once
    assert len(pipe.variants) == 2 and len(evaluated) == 2
    assert evaluated[0] > trained_first[0]
    assert [c.graphs for c in pipe.compilation] == evaluated


def test_a_stage_that_does_not_compile_runs_eagerly_with_one_warning() -> None:
    # torch's testing backend fails on every graph with a relu: only stage 0 has one
    torch.manual_seed(2)
    model = Net(batch_norm=False)
    eager = copy.deepcopy(model)
    x = torch.randn(8, 16)
    options = {"backend": "relu_compile_error_TESTING_ONLY"}
    pipe = fxpipe.pipeline(model, x, CPU2, chunks=2, compile=options)
    relu = pipe.plan.stage_of["relu"]
    with pytest.warns(CompileWarning, match=rf"stage {relu} \(.*\) could not be compiled") as w:
        out, grads = _step(pipe, x)
    assert len([m for m in w if issubclass(m.category, CompileWarning)]) == 1
    want, want_grads = _step(eager, x)
    torch.testing.assert_close(out, want)
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], msg=name)
    records = pipe.compilation
    assert records[relu].eager_because == "ReluCompileError"
    assert all(r.compiled for j, r in enumerate(records) if j != relu)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileWarning)  # warned once, not on every call
        torch.testing.assert_close(pipe(x), eager(x))


def test_an_error_of_the_stage_itself_is_raised_as_without_compiling() -> None:
    class Fixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 8)
            self.c = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.a(x).reshape(3, -1).reshape(-1, 8))  # a batch of 3 written in

    x = torch.randn(12, 4)
    errors = []
    for compile in (False, FAST):
        torch.manual_seed(3)
        pipe = fxpipe.pipeline(Fixed(), x, CPU2, chunks=4, compile=compile)
        with pytest.raises(StageRunError) as info:
            pipe(x[:8])  # micro-batches of 2 rows
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    assert all(r.compiled for r in pipe.compilation)


def test_the_timeline_still_has_a_box_per_task_with_compiled_stages() -> None:
    torch.manual_seed(4)
    model = Net()
    x = torch.randn(8, 16)
    pipe = fxpipe.pipeline(model, x, CPU2, chunks=4, checkpoint="never", compile=FAST)
    _step(pipe, x)  # compiled outside the recording
    with fxpipe.record(pipe) as timeline:
        _step(pipe, x)
    forward = [t for t in timeline.tasks if t.phase == "forward"]
    assert sorted((t.i, t.j) for t in forward) == [(i, j) for i in range(4) for j in range(2)]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("yes", "must be True, False or a dict"),
        ({"backnd": "inductor"}, "has keys ['backnd']"),
        ({"mode": "fastest"}, "mode='fastest' is not one of"),
        ({"mode": "default", "options": {"max_autotune": True}}, "were both given"),
        ({"dynamic": "auto"}, "dynamic='auto' must be None, True or False"),
        ({"fullgraph": 1}, "fullgraph=1 must be a bool"),
        ({"backend": 3}, "backend=3 must be a backend name"),
    ],
)
def test_bad_compile_settings_are_refused_before_anything_is_built(value: object, words: str):
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as info:
        fxpipe.pipeline(model, torch.randn(4, 16), CPU2, compile=value)  # type: ignore[arg-type]
    assert words in str(info.value)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_compile_takes_true_a_dict_or_a_record() -> None:
    assert CompileOptions.of(True) == CompileOptions()
    assert CompileOptions.of(False) is None
    assert CompileOptions.of({"mode": "max-autotune"}) == CompileOptions(mode="max-autotune")
    record = CompileOptions(backend="aot_eager", dynamic=True)
    assert CompileOptions.of(record) is record


@pytest.mark.slow
def test_inductor_stages_equal_the_uncompiled_pipeline_within_float32_tolerance() -> None:
    """torch's default float32 tolerances (rtol 1.3e-6, atol 1e-5): inductor fuses and
    reorders reductions, so results differ from eager by rounding only."""
    torch.manual_seed(5)
    model = Net()
    plain = copy.deepcopy(model)
    x = torch.randn(10, 16)
    pipe = fxpipe.pipeline(model, x, CPU2, chunks=2, compile=True)
    reference = fxpipe.pipeline(plain, x, CPU2, chunks=2)
    for _ in range(2):
        out, grads = _step(pipe, x)
        want, want_grads = _step(reference, x)
        torch.testing.assert_close(out, want)
        for name in grads:
            torch.testing.assert_close(grads[name], want_grads[name], msg=name)
    assert all(r.compiled and r.graphs > 0 and r.seconds > 0 for r in pipe.compilation)


@pytest.mark.slow
def test_inductor_dropout_recomputes_the_masks_of_its_forward() -> None:
    """Inductor draws dropout masks its own way (not eager's), from seeds it takes from
    torch's generator: the recompute of a checkpointed stage, run from the forward's RNG
    state, must draw the same masks, so checkpoint="always" equals "never" exactly."""
    torch.manual_seed(7)
    model = Net(p=0.5, batch_norm=False)
    x = torch.randn(8, 16)
    results = []
    for checkpoint in ("always", "never"):
        copied = copy.deepcopy(model)
        pipe = fxpipe.pipeline(copied, x, CPU2, chunks=2, checkpoint=checkpoint, compile=True)
        torch.manual_seed(8)
        results.append(_step(pipe, x))
        assert all(r.compiled for r in pipe.compilation)
    (out, grads), (want, want_grads) = results
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=0, atol=0, msg=name)
    pipe.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
