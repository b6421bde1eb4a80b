"""The executor against eager PyTorch: outputs, gradients, ordering, errors, modes."""

from __future__ import annotations

import copy
import threading
import traceback
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from threads import live_threads
from torch import nn
from torch.utils._pytree import tree_flatten

from fxpipe.errors import ConfigError, InputError
from fxpipe.ir import StageProgram, ValueRef
from fxpipe.runtime import executor as executor_module
from fxpipe.runtime.batchnorm import convert_deferred_batch_norm
from fxpipe.runtime.checkpoint import is_checkpointing, is_recomputing
from fxpipe.runtime.executor import Executor
from fxpipe.runtime.microbatch import gather, scatter

MODES = ["always", "except_last", "never"]

# ----------------------------------------------------------------- probes called from graphs

PROBE: dict[str, Any] = {"fail_at": None, "calls": [], "log": [], "flags": []}


def _probe(x: torch.Tensor, j: int) -> torch.Tensor:
    """Counts forward calls of stage ``j``, records checkpoint flags, raises on demand."""
    if not is_recomputing():
        PROBE["calls"].append(j)
        PROBE["flags"].append((j, is_checkpointing()))
        if PROBE["fail_at"] == (j, PROBE["calls"].count(j)):
            raise _StageFailure(f"stage {j} failed")
    return x


class _StageFailure(Exception):
    pass


class _Log(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, i: int, j: int) -> torch.Tensor:
        ctx.cell = (i, j)
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        PROBE["log"].append(ctx.cell)
        return grad, None, None


def _log(x: torch.Tensor, tag: torch.Tensor, j: int) -> torch.Tensor:
    """Records ``(micro-batch, stage)`` when the gradient passes; ``tag`` holds the index."""
    result: torch.Tensor = _Log.apply(x, int(tag[0, 0]), j)
    return result


torch.fx.wrap("_probe")
torch.fx.wrap("_log")


@pytest.fixture(autouse=True)
def _reset_probe() -> None:
    PROBE.update(fail_at=None, calls=[], log=[], flags=[])


@pytest.fixture(autouse=True, params=["here", "threads"])
def _where(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs twice: stages in the calling thread (one device's default) and in
    worker threads (what several devices use)."""
    original = Executor.__init__

    def init(self: Executor, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.use_threads = request.param == "threads"

    monkeypatch.setattr(Executor, "__init__", init)


# ------------------------------------------------------------------------ the test model


class Net(nn.Module):
    """Eager oracle: a skip read two stages later, a weight reused as a boundary value."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, extra: dict[str, torch.Tensor]) -> tuple[Any, ...]:
        a = torch.tanh(self.embed(x))
        b = torch.relu(self.mid(a))
        c = self.head(b) + a * extra["s"]
        return (c @ self.embed.weight) / b.size(1), a


class Stage0(nn.Module):
    def __init__(self, net: Net) -> None:
        super().__init__()
        self.embed = net.embed

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        a = torch.tanh(self.embed(_probe(x, 0)))
        return a, self.embed.weight


class Stage1(nn.Module):
    def __init__(self, net: Net) -> None:
        super().__init__()
        self.mid = net.mid

    def forward(self, a: torch.Tensor) -> tuple[Any, ...]:
        b = torch.relu(self.mid(_probe(a, 1)))
        return b, b.size(1)


class Stage2(nn.Module):
    def __init__(self, net: Net) -> None:
        super().__init__()
        self.head = net.head

    def forward(self, a: Any, b: Any, n: Any, w: Any, extra: Any) -> tuple[Any, ...]:
        c = self.head(_probe(b, 2)) + a * extra["s"]
        return ((c @ w) / n,)


def _program(net: Net) -> StageProgram:
    return StageProgram(
        modules=tuple(torch.fx.symbolic_trace(s(net)) for s in (Stage0, Stage1, Stage2)),
        inputs=(("x",), ("a",), ("a", "b", "n", "w", "extra")),
        outputs=(("a", "w"), ("b", "n"), ("out",)),
        graph_inputs=("x", "extra"),
        output_leaves=(ValueRef("out"), ValueRef("a")),
        output_spec=tree_flatten((0, 0))[1],
    )


def _inputs(batch: int = 10) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return torch.randn(batch, 4, requires_grad=True), {"s": torch.randn(batch, 8)}


def _pipelined(
    executor: Executor, x: torch.Tensor, extra: dict[str, torch.Tensor], chunks: int
) -> list[Any]:
    batches = scatter((x, extra), chunks, names=["x", "extra"])
    results = executor.run(batches, ["out", "a"])
    return gather([[r["out"], r["a"]] for r in results], torch.device("cpu"))


def _grads(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    grads = []
    for t in tensors:
        assert t.grad is not None
        grads.append(t.grad.clone())
        t.grad = None
    return grads


def _loss(out: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum() + a.sum()


# ---------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("chunks", [1, 2, 4, 7])
@pytest.mark.parametrize("mode", MODES)
def test_outputs_and_gradients_equal_eager(chunks: int, mode: str) -> None:
    net = Net()
    x, extra = _inputs()
    expected = net(x, extra)
    _loss(*expected).backward()
    expected_grads = _grads([x, *net.parameters()])
    executor = Executor(_program(net), ["cpu", "cpu:0", torch.device("cpu")], mode)
    out, a = _pipelined(executor, x, extra, chunks)
    assert torch.allclose(out, expected[0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(a, expected[1], rtol=1e-5, atol=1e-6)
    _loss(out, a).backward()
    for e, g in zip(expected_grads, _grads([x, *net.parameters()]), strict=True):
        assert torch.allclose(e, g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "mode, batch, expected",
    [("always", 8, 4), ("except_last", 8, 3), ("never", 8, 0), ("except_last", 2, 1)],
)
def test_checkpoint_stop_counts_real_micro_batches(mode: str, batch: int, expected: int) -> None:
    net = Net()
    x, extra = _inputs(batch)
    _pipelined(Executor(_program(net), ["cpu"] * 3, mode), x, extra, chunks=4)
    for j in range(3):
        assert [c for k, c in PROBE["flags"] if k == j].count(True) == expected


@pytest.mark.parametrize("mode", MODES)
def test_no_grad_attaches_nothing(mode: str) -> None:
    net = Net()
    x, extra = _inputs()
    with torch.no_grad():
        expected = net(x, extra)
        out, a = _pipelined(Executor(_program(net), ["cpu"] * 3, mode), x, extra, 4)
    assert out.grad_fn is None and a.grad_fn is None
    assert not any(flag for _, flag in PROBE["flags"])
    assert torch.allclose(out, expected[0], rtol=1e-5, atol=1e-6)


def test_eval_mode_is_never_checkpointed() -> None:
    net = Net()
    program = _program(net)
    for gm in program.modules:
        gm.eval()
    x, extra = _inputs()
    out, _ = _pipelined(Executor(program, ["cpu"] * 3, "always"), x, extra, 4)
    assert not any(flag for _, flag in PROBE["flags"])
    assert out.requires_grad


def test_autocast_reaches_the_stages() -> None:
    net = Net()
    x, extra = _inputs()
    executor = Executor(_program(net), ["cpu"] * 3, "except_last")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = net(x, extra)
        out, a = _pipelined(executor, x, extra, 4)
    assert out.dtype == a.dtype == expected[0].dtype == torch.bfloat16
    assert torch.allclose(out.float(), expected[0].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("error", [_StageFailure, KeyboardInterrupt])
def test_stage_error_stops_early_and_leaves_no_thread(error: type[BaseException]) -> None:
    net = Net()
    executor = Executor(_program(net), ["cpu"] * 3, "except_last")
    x, extra = _inputs(8)
    before = live_threads()
    PROBE["fail_at"] = (1, 2)  # stage 1, micro-batch 1: clock tick 2
    if error is KeyboardInterrupt:
        executor.program.modules[1].register_forward_pre_hook(_interrupt_on_second_call())
        PROBE["fail_at"] = None
    with pytest.raises(error) as info:
        _pipelined(executor, x, extra, chunks=4)
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert frames[-1] == ("_probe" if error is _StageFailure else "hook")
    # Tick 2 drained ((2, 0), (1, 1), (0, 2) ran); tick 3 never started.
    expected_calls = {0: 3, 1: 2 if error is _StageFailure else 1, 2: 1}
    assert {j: PROBE["calls"].count(j) for j in range(3)} == expected_calls
    assert live_threads() <= before  # no thread left behind
    # The executor is still usable.
    PROBE["fail_at"] = None
    if error is KeyboardInterrupt:
        executor.program.modules[1]._forward_pre_hooks.clear()
    out, a = _pipelined(executor, x, extra, chunks=4)
    assert torch.allclose(out, net(x, extra)[0], rtol=1e-5, atol=1e-6)


def _interrupt_on_second_call() -> Any:
    calls = []

    def hook(module: nn.Module, args: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    return hook


# ------------------------------------------------------------------------- backward order


class LogStage(nn.Module):
    def __init__(self, j: int) -> None:
        super().__init__()
        self.j = j
        self.lin = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, tag: torch.Tensor) -> tuple[torch.Tensor]:
        return (_log(torch.tanh(self.lin(h)), tag, self.j),)


class TagFirstStage(LogStage):
    """:class:`LogStage` with its inputs the other way round: the first float one (the tag,
    read by no differentiable op) carries no gradient."""

    def forward(self, tag: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor]:  # type: ignore[override]
        return super().forward(h, _tag_seen(tag))


def _tag_seen(tag: torch.Tensor) -> torch.Tensor:
    """``tag``, whether it carries a gradient recorded."""
    PROBE["flags"].append(("tag carries a gradient", tag.requires_grad))
    return tag


torch.fx.wrap("_tag_seen")


def _log_program(n: int, tag_first: bool = False) -> StageProgram:
    names = ["x", *(f"h{j}" for j in range(1, n + 1))]
    stage = TagFirstStage if tag_first else LogStage
    return StageProgram(
        modules=tuple(torch.fx.symbolic_trace(stage(j)) for j in range(n)),
        inputs=tuple(("tag", names[j]) if tag_first else (names[j], "tag") for j in range(n)),
        outputs=tuple((names[j + 1],) for j in range(n)),
        graph_inputs=("x", "tag"),
        output_leaves=(ValueRef(names[-1]),),
        output_spec=tree_flatten((0,))[1],
    )


def _backward_order(
    mode: str, m: int = 4, n: int = 3, tag_first: bool = False
) -> dict[int, list[int]]:
    """Per stage, the micro-batches in the order their gradients left the stage's output.

    Autograd runs the ready node with the highest sequence number first, and sequence numbers
    count per thread. The loss term of micro-batch 0 is built here (high numbers), those of
    the others in fresh threads (low numbers), so autograd alone would start with
    micro-batch 0.
    """
    executor = Executor(_log_program(n, tag_first), ["cpu"] * n, mode)
    # tag first: x carries a gradient, so that every stage has an input that does
    x = [torch.randn(2, 4, requires_grad=tag_first) for _ in range(m)]
    batches = [(x[i], torch.full((2, 1), float(i))) for i in range(m)]
    outputs = [r[f"h{n}"] for r in executor.run(batches, [f"h{n}"])]
    for _ in range(200):  # outnumber the worker thread's nodes
        torch.ones(1, requires_grad=True) * 2
    terms = [outputs[0].sum()]
    for out in outputs[1:]:
        thread = threading.Thread(target=lambda out=out: terms.append(out.sum()))
        thread.start()
        thread.join()
    sum(terms[1:], terms[0]).backward()
    return {j: [i for i, k in PROBE["log"] if k == j] for j in range(n)}


@pytest.mark.parametrize("mode", MODES)
def test_backward_runs_in_reverse_micro_batch_order(mode: str) -> None:
    order = _backward_order(mode)
    assert order == {j: [3, 2, 1, 0] for j in range(3)}


@pytest.mark.parametrize("mode", MODES)
def test_the_order_is_kept_on_the_input_that_carries_a_gradient(mode: str) -> None:
    """A stage whose first float input carries no gradient (the tag, as a rotary table or a
    float mask a stage reads): the backward order holds, and the tag never carries one
    (joined to it, from micro-batch 1 on it did: autograd then differentiated by it, and a
    compiled stage compiled once more)."""
    order = _backward_order(mode, tag_first=True)
    assert order == {j: [3, 2, 1, 0] for j in range(3)}
    seen = [flag for what, flag in PROBE["flags"] if what == "tag carries a gradient"]
    assert len(seen) >= 4 * 3 and not any(seen), seen


@pytest.mark.parametrize("mode", MODES)
def test_backward_order_setup_discriminates(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Without fork/join the same setup goes backward in another order."""
    monkeypatch.setattr(executor_module, "fork", lambda t: (t, torch.empty(0)))
    monkeypatch.setattr(executor_module, "join", lambda t, phony: t)
    order = _backward_order(mode)
    assert order != {j: [3, 2, 1, 0] for j in range(3)}


# --------------------------------------------------------------------- deferred batch norm


class BNStage(nn.Module):
    def __init__(self, bn: nn.BatchNorm1d) -> None:
        super().__init__()
        self.bn = bn

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.bn(x),)


@pytest.mark.parametrize("batch", [16, 3])
def test_deferred_batch_norm_commits_per_mini_batch(batch: int) -> None:
    bn = nn.BatchNorm1d(3)
    reference = copy.deepcopy(bn)
    gm = torch.fx.symbolic_trace(BNStage(bn))
    wrappers = convert_deferred_batch_norm(gm)
    program = StageProgram(
        modules=(gm,),
        inputs=(("x",),),
        outputs=(("y",),),
        graph_inputs=("x",),
        output_leaves=(ValueRef("y"),),
        output_spec=tree_flatten((0,))[1],
    )
    executor = Executor(program, ["cpu"], "except_last")
    assert executor.deferred_batch_norms == (tuple(wrappers),)
    for _ in range(3):
        x = torch.randn(batch, 3, 5) * 4 + 1
        y = executor.run(scatter((x,), 4), ["y"])
        torch.cat([r["y"] for r in y]).sum().backward()
        reference(x)
    assert bn.num_batches_tracked.item() == 3
    assert torch.allclose(bn.running_mean, reference.running_mean, rtol=1e-5, atol=1e-6)
    assert torch.allclose(bn.running_var, reference.running_var, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ rejections


def test_rejections() -> None:
    program = _program(Net())
    with pytest.raises(ConfigError, match="one device per stage"):
        Executor(program, ["cpu"] * 2)
    executor = Executor(program, ["cpu"] * 3)
    x, extra = _inputs()
    with pytest.raises(InputError):
        executor.run([], ["out"])
    with pytest.raises(InputError, match="takes 2"):
        executor.run([(x,)], ["out"])
    with pytest.raises(ConfigError, match="nowhere"):
        executor.run([(x, extra)], ["nowhere"])


@pytest.mark.cuda
def test_cpu_input_through_a_cuda_stage() -> None:
    net = Net()
    x, extra = _inputs()
    expected = net(x, extra)
    _loss(*expected).backward()
    expected_grads = _grads([x, *net.parameters()])
    program = _program(net)
    program.modules[1].cuda()
    out, a = _pipelined(Executor(program, ["cpu", "cuda", "cpu"], "except_last"), x, extra, 4)
    _loss(out, a).backward()
    assert torch.allclose(out, expected[0], rtol=1e-4, atol=1e-5)
    for e, g in zip(expected_grads, _grads([x, *net.parameters()]), strict=True):
        assert torch.allclose(e, g.cpu(), rtol=1e-4, atol=1e-5)
