"""fxpipe.distributed.rank.asynchronous (``schedule="Async1F1B"``) against a plain sequential
simulation of its update rule written apart from it (``async_oracle.simulate``): the
pipelined run's final weights and losses equal the simulation's in float64 for each
staleness mitigation, on 2 and 3 ranks, with a tied weight, dropout, an update every one
and every two micro-batches, a flush in the middle, SGD with momentum, AdamW with a
learning-rate scheduler and clipping, and on a 2 x 2 mesh. A Hugging Face Llama in float32
and bfloat16 is no further from float64 than eager. A run resumed from a checkpoint equals
the run without the break; a refused batch is refused on every rank; what does not compose
is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe.distributed as fd
from fxpipe.distributed.options import ScheduleOptions
from fxpipe.errors import ConfigError, FxPipeError
from tests.distributed.rank.async_oracle import simulate
from tests.distributed.ranks import launch, preload, results

preload(__name__)

WIDTH, ROWS, N_MB, STEPS = 6, 4, 2, 3


class Chain(nn.Module):
    """Blocks of equal cost (so the split falls between them), dropout inside each, and a
    head that reads the first block's weight (a weight tied across the first and last
    stage)."""

    def __init__(self, blocks: int, p: float = 0.2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(blocks))
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(self.drop(block(x)))
        return x @ self.blocks[0].weight  # the tied head

    def stage(self, ops: list[tuple[str, int]]) -> Callable[[dict[str, Any], Any], Any]:
        """The ops of one stage (``("linear", i)``, ``("drop", 0)``, ``("tanh", 0)``,
        ``("head", 0)``, in the model's order) as a function of its weights by the
        pipeline's names, for the simulation."""

        def run(weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            for op, i in ops:
                if op == "linear":
                    w, b = weights[f"blocks.{i}.weight"], weights[f"blocks.{i}.bias"]
                    x = torch.nn.functional.linear(x, w, b)
                elif op == "drop":
                    x = self.drop(x)
                elif op == "tanh":
                    x = torch.tanh(x)
                else:
                    x = x @ weights["blocks.0.weight"]
            return x

        return run


def _ops(pipe: Any) -> list[tuple[str, int, int]]:
    """Each op of the model's forward, in order, with the stage the plan put it on."""
    out = []
    for node in pipe.plan.graph_module.graph.nodes:
        target = str(node.target)
        if node.op == "call_module":
            op = (
                ("linear", int(target.split(".")[1]))
                if target.startswith("blocks")
                else ("drop", 0)
            )
        elif "linear" in target:  # a block whose weight is tied is traced through
            op = ("linear", int(str(node.args[1].target).split(".")[1]))
        elif node.op == "call_function":
            op = ("tanh", 0) if "tanh" in target else ("head", 0)
        else:
            continue
        out.append((*op, pipe.plan.stage_of[node.name]))
    return out


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()


def _data(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    make = lambda: torch.randn(ROWS, WIDTH, dtype=torch.float64, generator=g)  # noqa: E731
    return [(make(), make()) for _ in range(count)]


def _optimizer(kind: str) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    if kind == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01)
    return lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)


def _scheduler(kind: str) -> Callable[[torch.optim.Optimizer], Any] | None:
    if kind == "sgd":
        return None
    return lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


CASES = [  # (staleness, step_every, optimizer, flush after step)
    ("stash", 1, "sgd", None),
    ("predict", 1, "sgd", None),
    ("none", 1, "sgd", None),
    ("stash", 2, "adamw", 1),
    ("predict", 2, "adamw", 1),
    ("none", 2, "adamw", 1),
]


def _train(rank: int, world: int) -> dict[str, Any]:
    """Every case on this rank: its stage's final weights and (last rank) the losses."""
    out: dict[str, Any] = {}
    for case in CASES:
        staleness, every, kind, flush_at = case
        torch.manual_seed(0)
        model = Chain(2 * world).double()
        x = torch.zeros(ROWS * N_MB, WIDTH, dtype=torch.float64)
        pipe = fd.pipeline_schedule(
            model, x, n_microbatches=N_MB, loss_fn=_loss, schedule="Async1F1B",
            scale_grads=False, staleness=staleness, step_every=every,
        )  # fmt: skip
        opt = _optimizer(kind)(pipe.parameters())
        make = _scheduler(kind)
        pipe.schedule.attach(opt, None if make is None else make(opt), max_grad_norm=5.0)
        torch.manual_seed(100 + rank)  # this rank's dropout draws
        data, losses = _data(STEPS * N_MB), []
        for s in range(STEPS):
            batch = data[s * N_MB : (s + 1) * N_MB]
            xs, ts = torch.cat([b[0] for b in batch]), torch.cat([b[1] for b in batch])
            if pipe.is_first:
                pipe.schedule.step(xs)
            elif pipe.is_last:
                step_losses = [0.0]  # emptied first, as torch's schedules do
                pipe.schedule.step(target=ts, losses=step_losses)
                losses += step_losses
            else:
                pipe.schedule.step()
            if s == flush_at:
                pipe.schedule.flush()
        pipe.schedule.flush()
        out[str(case)] = {
            "weights": {n: p.detach().clone() for n, p in pipe.named_parameters()},
            "losses": [float(v) for v in losses],
            "staleness": [s.stale for s in pipe.schedule.plan().stages],
            "ops": _ops(pipe),
        }
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_each_mitigation_equals_the_simulation_of_its_rule(tmp_path: Path, world: int) -> None:
    runs = results(launch(_train, world, tmp_path))
    blocks = 2 * world
    for case in CASES:
        staleness, every, kind, flush_at = case
        got = [run[str(case)] for run in runs]
        torch.manual_seed(0)
        model = Chain(blocks).double()
        held = [set(g["weights"]) for g in got]
        ops = got[0]["ops"]
        stages = [model.stage([(op, i) for op, i, j in ops if j == s]) for s in range(world)]
        params = [{n: dict(model.named_parameters())[n].detach() for n in names} for names in held]
        rng = []
        for s in range(world):
            torch.manual_seed(100 + s)
            rng.append(torch.get_rng_state())
        want = simulate(
            stages, params, _data(STEPS * N_MB), _loss, _optimizer(kind),
            mitigation=staleness, step_every=every,
            flush_after=() if flush_at is None else ((flush_at + 1) * N_MB,),
            tied=[{(0, "blocks.0.weight"), (world - 1, "blocks.0.weight")}],
            rng_states=rng, make_scheduler=_scheduler(kind), max_grad_norm=5.0,
        )  # fmt: skip
        for s in range(world):
            for name, value in got[s]["weights"].items():
                torch.testing.assert_close(
                    value, want.params[s][name], rtol=1e-9, atol=1e-11, msg=f"{case} {s} {name}"
                )
        assert got[-1]["losses"] == pytest.approx(want.losses, rel=1e-9), case
        assert got[0]["staleness"] == [max(d) for d in want.staleness], case


def _mesh(rank: int, world: int) -> dict[str, Any]:
    """A 2 x 2 ("pp", "dp") mesh without dropout: each replica its own half of every
    micro-batch, each update averaging the replicas' gradients (and summing the tied
    weight's copies first)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    replica = mesh.get_local_rank("dp")
    out = {}
    for staleness in ("stash", "predict"):
        torch.manual_seed(0)
        x = torch.zeros(ROWS * N_MB // 2, WIDTH, dtype=torch.float64)
        pipe = fd.pipeline_schedule(
            Chain(4, p=0.0).double(), x, n_microbatches=N_MB, loss_fn=_loss, mesh=mesh,
            schedule="async", scale_grads=False, staleness=staleness, step_every=1,
        )  # fmt: skip
        pipe.schedule.attach(_optimizer("sgd")(pipe.parameters()))
        losses: list[Any] = []
        for s in range(STEPS):
            batch = _data(STEPS * N_MB)[s * N_MB : (s + 1) * N_MB]
            half = lambda t: t.chunk(2)[replica]  # noqa: E731
            xs = torch.cat([half(b[0]) for b in batch])
            ts = torch.cat([half(b[1]) for b in batch])
            if pipe.is_first:
                pipe.schedule.step(xs)
            else:
                pipe.schedule.step(target=ts, losses=losses)
        pipe.schedule.flush()
        out[staleness] = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        out["ops " + staleness] = _ops(pipe)
    return out


def test_a_mesh_averages_its_replicas_at_each_update(tmp_path: Path) -> None:
    runs = results(launch(_mesh, 4, tmp_path))
    for staleness in ("stash", "predict"):
        torch.manual_seed(0)
        model = Chain(4, p=0.0).double()
        ops = runs[0]["ops " + staleness]
        stages = [model.stage([(op, i) for op, i, j in ops if j == s]) for s in range(2)]
        named = dict(model.named_parameters())
        stage_of = {0: runs[0][staleness], 1: runs[2][staleness]}  # ranks 0, 1 hold stage 0
        params = [{n: named[n].detach() for n in stage_of[s]} for s in range(2)]
        want = simulate(
            stages, params, _data(STEPS * N_MB), lambda o, t: _loss(o, t) / 2,
            _optimizer("sgd"), mitigation=staleness, step_every=1,
            tied=[{(0, "blocks.0.weight"), (1, "blocks.0.weight")}],
        )  # fmt: skip
        for rank, run in enumerate(runs):
            s = rank // 2
            for name, value in run[staleness].items():
                torch.testing.assert_close(
                    value, want.params[s][name], rtol=1e-9, atol=1e-11, msg=f"{rank} {name}"
                )


class _Recorded(torch.optim.SGD):
    """SGD that keeps the gradients each of its steps applied (by Parameter)."""

    def step(self, closure: Any = None) -> Any:
        self.applied = [
            {id(p): p.grad.clone() for p in g["params"] if p.grad is not None}
            for g in self.param_groups
        ][0]
        return super().step(closure)


def _hf_gradients(rank: int, world: int) -> dict[str, Any]:
    """A Hugging Face Llama (keyword mask, a padded row) in float32 and bfloat16 through the
    asynchronous schedule, every stage updating once, at the flush: the gradient each
    Parameter's update applied."""
    from tests.distributed.test_build_hf import _batch, _build
    from tests.distributed.test_build_hf import _loss as lm_loss

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        ids, kwargs, target = _batch()
        pipe = fd.pipeline_schedule(
            _build("llama").to(dtype), ids, example_kwargs=kwargs, n_microbatches=N_MB,
            loss_fn=lm_loss, schedule="async", scale_grads=False, step_every=100,
        )  # fmt: skip
        opt = _Recorded(pipe.parameters(), lr=0.1)
        pipe.schedule.attach(opt)
        if pipe.is_first:
            pipe.schedule.step(ids, **kwargs)
        else:
            pipe.schedule.step(target=target, losses=[])
        pipe.schedule.flush()
        out[str(dtype)] = {k: opt.applied[id(p)] for k, p in pipe.named_parameters()}
    return out


def test_a_hugging_face_model_in_float32_and_bfloat16_is_no_further_than_eager(
    tmp_path: Path,
) -> None:
    from oracle import no_further_than_eager

    from tests.distributed.test_build_hf import _batch, _build
    from tests.distributed.test_build_hf import _loss as lm_loss

    runs = results(launch(_hf_gradients, 2, tmp_path))

    def eager(dtype: torch.dtype) -> dict[str, torch.Tensor]:
        model = _build("llama").to(dtype)
        ids, kwargs, target = _batch()
        lm_loss(model(ids, **kwargs), target).backward()
        return {k: p.grad for k, p in model.named_parameters()}

    exact = eager(torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = eager(dtype)
        seen = set()
        for run in runs:
            for key, grad in run[str(dtype)].items():
                ok, ours, their = no_further_than_eager(grad, theirs[key], exact[key])
                assert ok, (dtype, key, ours, their)
                seen.add(key)
        assert seen == set(exact), sorted(set(exact) - seen)


def _refusal(call: Callable[[], Any]) -> str:
    """The message of the FxPipeError ``call`` raises ("" where it raises none)."""
    try:
        call()
    except FxPipeError as e:
        return str(e)
    return ""


def _batch_norm() -> None:
    """A model with batch statistics under the asynchronous schedule (refused)."""
    norm = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, 1))
    fd.pipeline_schedule(
        norm, torch.zeros(ROWS * N_MB, WIDTH), n_microbatches=N_MB, loss_fn=_loss,
        schedule="async", scale_grads=False,
    )  # fmt: skip


def _resume(rank: int, world: int, *, folder: str) -> dict[str, Any]:
    """Two steps, a flush, a checkpoint (refused before the flush), two more steps; and a
    second pipeline loaded from the checkpoint running the same two steps."""
    data = _data(4 * N_MB)

    def run(pipe: Any, steps: range, opt: Any) -> None:
        for s in steps:
            batch = data[s * N_MB : (s + 1) * N_MB]
            xs, ts = torch.cat([b[0] for b in batch]), torch.cat([b[1] for b in batch])
            if pipe.is_first:
                pipe.schedule.step(xs)
            else:
                pipe.schedule.step(target=ts, losses=[])

    def build() -> tuple[Any, Any]:
        torch.manual_seed(0)
        x = torch.zeros(ROWS * N_MB, WIDTH, dtype=torch.float64)
        pipe = fd.pipeline_schedule(
            Chain(4).double(), x, n_microbatches=N_MB, loss_fn=_loss, schedule="async",
            scale_grads=False, staleness="predict",
        )  # fmt: skip
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
        pipe.schedule.attach(opt)
        return pipe, opt

    batch_norm = _refusal(_batch_norm)
    pipe, opt = build()
    torch.manual_seed(100 + rank)
    run(pipe, range(2), opt)
    try:
        pipe.save_checkpoint(f"{folder}/ckpt", opt)
        refused = ""
    except ConfigError as e:
        refused = str(e)
    pipe.schedule.flush()
    pipe.save_checkpoint(f"{folder}/ckpt", opt)
    state = torch.get_rng_state()
    run(pipe, range(2, 4), opt)
    pipe.schedule.flush()
    again, opt2 = build()
    again.load_checkpoint(f"{folder}/ckpt", opt2)
    torch.set_rng_state(state)
    run(again, range(2, 4), opt2)
    again.schedule.flush()
    resumed = {n: p.detach().clone() for n, p in again.named_parameters()}
    wrong = torch.zeros(3, WIDTH, dtype=torch.float64)  # 3 rows: not the example's
    if again.is_first:  # refused by the first rank, which tells the next: raised on both
        bad = _refusal(lambda: again.schedule.step(wrong))
    else:
        bad = _refusal(lambda: again.schedule.step(target=wrong, losses=[]))
    run(again, range(1), opt2)  # the stream goes on
    again.schedule.flush()
    return {
        "bad batch": bad,
        "refused": refused,
        "batch norm": batch_norm,
        "straight": {n: p.detach() for n, p in pipe.named_parameters()},
        "resumed": resumed,
    }


def test_a_resumed_run_equals_the_run_without_the_break(tmp_path: Path) -> None:
    for rank, run in enumerate(results(launch(_resume, 2, tmp_path, folder=str(tmp_path)))):
        assert "flush()" in run["refused"], (rank, run["refused"])  # on every rank
        assert "GroupNorm" in run["batch norm"], (rank, run["batch norm"])
        assert ("rows" if rank == 0 else "first rank refused") in run["bad batch"], run
        for name, value in run["straight"].items():
            torch.testing.assert_close(run["resumed"][name], value, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"scale_grads": True}, "scale_grads=False"),
        ({"compile": True}, "compile=False"),
        ({"tensor_parallel": "auto"}, "tensor_parallel=None"),
        ({"data_parallel": "fsdp"}, "data_parallel='ddp'"),
        ({"stages_per_rank": 2}, "stages_per_rank=1"),
        ({"staleness": "later"}, "'stash'"),
        ({"step_every": 0}, "step_every"),
    ],
)
def test_what_does_not_compose_is_refused_with_the_remedy(
    options: dict[str, Any], words: str
) -> None:
    settings = {"n_microbatches": 2, "schedule": "Async1F1B", "scale_grads": False, **options}
    with pytest.raises(ConfigError) as caught:
        ScheduleOptions(**settings)
    assert words in str(caught.value), caught.value


def test_staleness_options_need_the_asynchronous_schedule() -> None:
    with pytest.raises(ConfigError, match="schedule='Async1F1B'"):
        ScheduleOptions(n_microbatches=2, schedule="1f1b", staleness="predict")
    assert ScheduleOptions(n_microbatches=2, schedule="ASYNC", scale_grads=False).schedule == (
        "async1f1b"
    )
