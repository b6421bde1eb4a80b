"""fxpipe.distributed against eager PyTorch: several processes on the CPU, gloo on loopback.

Each test starts its ranks with torch.multiprocessing (from a fork server), joins every one
of them under a hard time limit (killing the rest and failing past it), and reads what each
rank saved.
Losses are sum-reduced with ``scale_grads=False`` (passed explicitly: the default is True, as
in torch's schedules), so the summed micro-batch losses and the gradients equal the eager
model's on the whole batch (one test uses ``scale_grads=True`` and compares with the eager
gradients divided by the number of micro-batches).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
if str(TESTS.parent) not in sys.path:  # the ranks import this module by its package path
    sys.path.append(str(TESTS.parent))

from helpers import sweep  # noqa: E402
from models import ZOO, FixedRows, LocalConvTokens, ResidualMLP, TinyGPT  # noqa: E402

import fxpipe.distributed as fd  # noqa: E402
from fxpipe.distributed.ownership import is_dtensor  # noqa: E402
from fxpipe.errors import CheckpointError, ConfigError, FxPipeError, PlanError  # noqa: E402

TIME_LIMIT = 120.0  # seconds per test, all ranks together
BATCH, N_MB = 8, 4

Problem = tuple[Callable[[], nn.Module], tuple[Any, ...], dict[str, Any], Callable[..., Any], Any]


# ---------------------------------------------------------------------------- problems


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def _sum_sq(out: Any, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()


def _dict_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    assert isinstance(out, dict) and set(out) == {"logits", "aux"}, type(out)
    return ((out["logits"] - target) ** 2).sum() + (out["aux"] ** 2).sum()


def _lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten(), reduction="sum")


def _llama_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    assert isinstance(out, dict) and set(out) == {"logits", "last_hidden_state"}, type(out)
    return _lm_loss(out["logits"], target) + out["last_hidden_state"].square().sum()


def _tiny_gpt() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TinyGPT(p=0.0)  # no dropout: the oracle is exact


def _problem(name: str, batch: int = BATCH) -> Problem:
    """Model factory (same weights each call), example args and kwargs, loss, target."""
    if name == "transformer":
        args, kwargs = ZOO["transformer"].example(batch)
        target = torch.randint(0, 64, args[0].shape, generator=_gen())
        return _tiny_gpt, args, kwargs, _lm_loss, target
    case = ZOO[name]
    args, kwargs = case.example(batch)
    if name == "llama":
        target = torch.randint(0, 64, args[0].shape, generator=_gen())
        return case.build, args, kwargs, _llama_loss, target
    out = case.build()(*args, **kwargs)
    logits = out["logits"] if isinstance(out, dict) else out
    target = torch.randn(logits.shape, generator=_gen())
    return case.build, args, kwargs, _dict_loss if name == "multi_io_dict" else _sum_sq, target


def _eager(name: str, batch: int = BATCH) -> tuple[nn.Module, float]:
    build, args, kwargs, loss_fn, target = _problem(name, batch)
    model = build()
    loss = loss_fn(model(*args, **kwargs), target)
    loss.backward()
    return model, loss.item()


# ---------------------------------------------------------------------------- rank jobs


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor: FSDP's DTensors gathered (a collective over "dp")."""
    return t.full_tensor() if is_dtensor(t) else t.clone()


def _step(pipe: fd.DistributedPipeline, args: Any, kwargs: Any, target: Any) -> list[Any]:
    losses: list[Any] = []
    if pipe.is_first:
        tgt = target if pipe.is_last else None
        pipe.schedule.step(*args, target=tgt, losses=losses, **kwargs)
    elif pipe.is_last:
        pipe.schedule.step(target=target, losses=losses)
    else:
        pipe.schedule.step()
    return losses


def _train(
    rank: int,
    world: int,
    *,
    name: str,
    schedule: str,
    spr: int = 1,
    scale_grads: bool = False,
    dp: int = 1,
    data_parallel: str = "ddp",
) -> dict[str, Any]:
    """One pipelined step, then one SGD step; gradients and the state-dict shard (whole
    tensors, gathered from FSDP's shards). With ``dp > 1``: a (world / dp) x dp mesh,
    replica ``i`` taking the i-th slice of a global batch of ``dp * BATCH``."""
    build, args, kwargs, loss_fn, target = _problem(name, dp * BATCH)
    model = build()
    mesh, replica = None, 0
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
        replica = mesh.get_local_rank("dp")
        args, kwargs, target = tree_map(
            lambda t: t.chunk(dp)[replica] if isinstance(t, torch.Tensor) else t,
            (args, kwargs, target),
        )
    pipe = fd.pipeline_schedule(
        model,
        args,
        example_kwargs=kwargs,
        schedule=schedule,
        n_microbatches=N_MB,
        loss_fn=loss_fn,
        stages_per_rank=spr,
        scale_grads=scale_grads,
        mesh=mesh,
        data_parallel=data_parallel,
    )
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _step(pipe, args, kwargs, target)
    pipe.sync_tied_gradients()
    own = dict(pipe.named_parameters())
    sharded = sorted(k for k, p in own.items() if is_dtensor(p))
    grads = {k: _whole(p.grad) for k, p in own.items() if p.grad is not None}
    kept = [k for k, p in model.named_parameters() if k not in own and not p.is_meta]
    torch.optim.SGD(pipe.parameters(), lr=0.01).step()
    gm = pipe.plan.graph_module
    attrs = {n.name for n in gm.graph.nodes if n.op == "get_attr"}
    shared = {
        pipe.plan.stage_of[u.name]
        for n in gm.graph.nodes
        if n.op in ("get_attr", "call_module") and str(n.target).startswith("shared")
        for u in (n.users if n.op == "get_attr" else [n])
    }
    return {
        "stages": pipe.stage_indices,
        "replica": replica,
        "loss": float(sum(losses)) if losses else None,
        "grads": grads,
        "shard": {k: _whole(v) for k, v in pipe.state_dict().items()},
        "sharded": sharded,
        "replicated": pipe.replicated_keys,
        "sent_attrs": [e.value for e in pipe.plan.edges if e.value in attrs],
        "not_released": kept,
        "stages_using_shared": shared,
        # FSDP warns when a wrapped stage returns a view (its backward hook could be lost)
        "view_warnings": [str(w.message) for w in caught if "view" in str(w.message)],
    }


def _bits(rank: int, world: int, *, name: str, n_mbs: tuple[int, ...]) -> dict[int, Any]:
    """The eager model's gradients on this rank (one thread, as the stages run), and, for a
    pipeline of each number of micro-batches, which of its gradients (tied copies summed)
    have exactly eager's bits."""
    build, args, kwargs, loss_fn, target = _problem(name)
    eager = build()
    loss_fn(eager(*args, **kwargs), target).backward()
    want = dict(eager.named_parameters())
    out = {}
    for n_mb in n_mbs:
        pipe = fd.pipeline_schedule(
            build(), args, example_kwargs=kwargs, n_microbatches=n_mb, loss_fn=loss_fn,
            scale_grads=False,
        )  # fmt: skip
        _step(pipe, args, kwargs, target)
        pipe.sync_tied_gradients()
        out[n_mb] = {
            "equal": {k: torch.equal(p.grad, want[k].grad) for k, p in pipe.named_parameters()},
            "replicated": pipe.replicated_keys,
        }
    return out


def _batch_checks(rank: int, world: int) -> dict[str, Any]:
    """What splitting the batch changes, on each rank: a batch size written into the model is
    refused when the pipeline is built (the model untouched), and BatchNorm in training
    mode is warned about once, at the first step (none in eval mode)."""
    import warnings

    from fxpipe.errors import BatchStatisticsWarning

    fixed = FixedRows(rows=8, width=16, out=4)  # fits batches of 8 rows only
    try:
        fd.pipeline_schedule(fixed, torch.randn(BATCH, 16), n_microbatches=N_MB, loss_fn=_sum_sq)
        refused = ""
    except PlanError as e:
        refused = str(e)
    build, args, kwargs, loss_fn, target = _problem("resnet")
    seen = {}
    for mode in ("train", "eval"):
        model = build().train(mode == "train")
        pipe = fd.pipeline_schedule(model, args, n_microbatches=N_MB, loss_fn=loss_fn)
        counts = []
        for _ in range(2):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _step(pipe, args, kwargs, target)
            found = [w for w in caught if issubclass(w.category, BatchStatisticsWarning)]
            counts.append(len(found))
            seen[f"{mode}_text"] = seen.get(f"{mode}_text", "") + "".join(
                str(w.message) for w in found
            )
        seen[mode] = counts
    return {
        "refused": refused,
        "untouched": all(not p.is_meta for p in fixed.parameters()),
        **seen,
    }


def _forgotten_sum(
    rank: int, world: int, *, dp: int = 1, schedule: str = "gpipe"
) -> dict[str, Any]:
    """The tied-embedding transformer, on a pipeline or (dp=2) a 2 x 2 FSDP mesh: gradient
    accumulation (two steps, one sum, one update), a load between steps, then an update
    without the sum, which the next step refuses on every rank holding a copy before
    anything is sent. Under ZBV rank 0 holds the embedding and the head, and FSDP leaves
    the weight whole on each replica: only rank 0 holds it (the other does not step)."""
    build, args, kwargs, loss_fn, target = _problem("transformer", dp * BATCH)
    mesh = None
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
        args, kwargs, target = tree_map(
            lambda t: t.chunk(dp)[mesh.get_local_rank("dp")], (args, kwargs, target)
        )
    pipe = fd.pipeline_schedule(
        build(), args, example_kwargs=kwargs, n_microbatches=N_MB, loss_fn=loss_fn,
        mesh=mesh, data_parallel="fsdp", schedule=schedule,
        stages_per_rank=2 if schedule == "zbvzerobubble" else 1,
    )  # fmt: skip
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    for _ in range(2):  # accumulation: two steps, then one sum and one update
        _step(pipe, args, kwargs, target)
    pipe.sync_tied_gradients()
    optimizer.step()
    optimizer.zero_grad()
    _step(pipe, args, kwargs, target)
    pipe.load_stage_state_dict(build().state_dict())  # the same values on every rank
    _step(pipe, args, kwargs, target)
    optimizer.step()  # the sum forgotten
    if not set(pipe.replicated_keys) & {k for k, _ in pipe.named_parameters()}:
        return {"refused": None}  # holds no copy: its peers stop before sending to it
    try:
        _step(pipe, args, kwargs, target)
        refused = ""
    except ConfigError as e:
        refused = str(e)
    return {"refused": refused}


def _sync(rank: int, world: int) -> dict[str, Any]:
    """``sync_tied_gradients`` sums the copies of a Parameter held on several ranks. fxpipe's
    tracer gives every Parameter one home stage, so the copies here are made up: one held by
    both ranks, one by rank 0 only."""
    build, args, _, loss_fn, _ = _problem("mlp_residual")
    pipe = fd.pipeline_schedule(build(), args, n_microbatches=N_MB, loss_fn=loss_fn)
    assert pipe.replicated_keys == ()
    pipe.sync_tied_gradients()  # nothing to sum: no communication
    both, mine = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))
    both.grad, mine.grad = torch.full((3,), rank + 1.0), torch.ones(2, 2)
    shapes = (both.shape, mine.shape)
    pipe._own.replicated = [
        ("both", shapes[0], both),
        ("mine", shapes[1], mine if rank == 0 else None),
    ]
    pipe._own.shared_keys = frozenset({"both", "mine"})
    pipe.sync_tied_gradients()
    return {"both": both.grad, "mine": mine.grad}


def _meta_model(rank: int, world: int, *, dp: int = 1) -> dict[str, Any]:
    """A model built on ``meta``: planned, its stage materialised and loaded, trained. With
    ``dp > 1``: replicas over a (world / dp) x dp mesh with FSDP, each loading its shards
    from the full state dict and training on its slice of a batch of ``dp * BATCH``."""
    _, args, kwargs, loss_fn, target = _problem("mlp_residual", dp * BATCH)
    with torch.device("meta"):
        model = ResidualMLP()
    mesh, replica = None, 0
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
        replica = mesh.get_local_rank("dp")
        args, target = tuple(a.chunk(dp)[replica] for a in args), target.chunk(dp)[replica]
    pipe = fd.pipeline_schedule(
        model, args, n_microbatches=N_MB, loss_fn=loss_fn, schedule="1f1b", mesh=mesh,
        data_parallel="fsdp", scale_grads=False,
    )  # fmt: skip
    own = dict(pipe.named_parameters())
    placed = all(not p.is_meta for p in own.values())
    released = all(p.is_meta for k, p in model.named_parameters() if k not in own)
    full = ZOO["mlp_residual"].build().state_dict()
    try:
        pipe.load_stage_state_dict({})
        refused = ""
    except ConfigError as e:
        refused = str(e)
    try:  # every rank stops before sending: its stages hold uninitialised memory
        _step(pipe, args, kwargs, target)
        unloaded = ""
    except ConfigError as e:
        unloaded = str(e)
    pipe.load_stage_state_dict(full)
    losses = _step(pipe, args, kwargs, target)
    grads = {k: _whole(p.grad) for k, p in own.items()}
    merged = pipe.gather_state_dict(dst=0)
    return {
        "placed": placed,
        "released": released,
        "refused": refused,
        "unloaded": unloaded,
        "grads": grads,
        "loss": float(sum(losses)) if losses else None,
        "merged": merged,
    }


def _lm_mean(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _optimizer(parameters: Any) -> torch.optim.Optimizer:
    """SGD with momentum: state to restore (Adam would amplify rounding on near-zero
    gradients, such as the rows of tokens the batch does not use, far above it)."""
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)


def _train_steps(
    pipe: fd.DistributedPipeline, optimizer: Any, args: Any, target: Any, steps: int
) -> list[float]:
    """``steps`` training steps; each one's mean micro-batch loss on the last stage."""
    out = []
    for _ in range(steps):
        optimizer.zero_grad()
        losses = _step(pipe, args, {}, target)
        pipe.sync_tied_gradients()
        optimizer.step()
        out.append(float(torch.stack(losses).mean()) if losses else float("nan"))
    return out


def _resume(
    rank: int, world: int, *, folder: str, other: str, data_parallel: str, schedule: str
) -> dict[str, Any]:
    """The tied-embedding transformer, SGD with momentum, a mean loss over a global batch of
    2 x BATCH: one step at 2 pipeline ranks x 2 replicas (``schedule``; ``data_parallel``
    over them; under ZBV, 4 stages, the tied weight left whole by FSDP on rank 0), saved
    with torch.distributed.checkpoint; then loaded at 4 stages x 1 replica (1F1B), which
    takes two more steps."""
    from torch.distributed.device_mesh import init_device_mesh

    _, args, _, _, target = _problem("transformer", 2 * BATCH)
    saved: dict[str, Any] = {}
    for layout, (pp, dp) in (("save", (2, 2)), ("load", (4, 1))):
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        replica = mesh.get_local_rank("dp")
        mine = (args[0].chunk(dp)[replica],), target.chunk(dp)[replica]
        kind = schedule if layout == "save" else "1f1b"
        pipe = fd.pipeline_schedule(
            _tiny_gpt(), mine[0], n_microbatches=N_MB, loss_fn=_lm_mean, scale_grads=True,
            mesh=mesh, schedule=kind, data_parallel=data_parallel,
            stages_per_rank=2 if kind == "zbvzerobubble" else 1,
        )  # fmt: skip
        optimizer = _optimizer(pipe.parameters())
        if layout == "save":
            saved["losses"] = _train_steps(pipe, optimizer, mine[0], mine[1], 1)
            pipe.save_checkpoint(folder, optimizer)
            shard = {k: _whole(v) for k, v in pipe.state_dict().items()}  # every replica
            if replica == 0:
                saved["shard"] = shard
        else:
            saved["refused"] = []
            for wrong in (other, folder + "-missing"):  # each rank alone, nothing sent
                try:
                    pipe.load_checkpoint(wrong, optimizer)
                except CheckpointError as e:
                    saved["refused"].append(str(e))
            pipe.load_checkpoint(folder, optimizer)
            saved["loaded"] = {k: v.clone() for k, v in pipe.state_dict().items()}
            saved["resumed"] = _train_steps(pipe, optimizer, mine[0], mine[1], 2)
    return saved


def _fail(
    rank: int, world: int, *, bad_rank: int, dp: int = 1, data_parallel: str = "ddp"
) -> dict[str, Any]:
    """Rank ``bad_rank``'s stage raises in its forward on the second step (with ``dp``: in
    one replica of a (world / dp) x dp mesh, whose other replica waits on it in DDP or
    FSDP)."""
    build, args, kwargs, loss_fn, target = _problem("mlp_residual", dp * BATCH)
    mesh = None
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
        replica = mesh.get_local_rank("dp")
        args, target = (args[0].chunk(dp)[replica],), target.chunk(dp)[replica]
    pipe = fd.pipeline_schedule(
        build(), args, n_microbatches=N_MB, loss_fn=loss_fn, mesh=mesh, data_parallel=data_parallel
    )
    calls = []

    def boom(*_: Any) -> None:
        calls.append(1)
        if len(calls) > N_MB:
            raise RuntimeError(f"injected failure on rank {rank}")

    if rank == bad_rank:
        pipe.stage_modules[0].register_forward_pre_hook(boom)
    for _ in range(3):
        _step(pipe, args, kwargs, target)
    return {}


class _Scaled(nn.Module):
    """A keyword argument that is not a tensor: traced as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * scale)


def _wrong_inputs(rank: int, world: int, *, what: str) -> dict[str, Any]:
    """A step, then one the first rank refuses before sending anything: on a batch twice
    the example's (torch sized every buffer from the example), or with another value of a
    non-tensor argument (the traced graph holds the example's)."""
    _, args, _, loss_fn, target = _problem("mlp_residual")
    pipe = fd.pipeline_schedule(
        _Scaled(), args, example_kwargs={"scale": 2.0}, n_microbatches=N_MB, loss_fn=loss_fn
    )
    _step(pipe, args, {"scale": 2.0}, target)
    if what == "batch":
        _, args, _, _, target = _problem("mlp_residual", 2 * BATCH)
    _step(pipe, args, {"scale": 2.0 if what == "batch" else 3.0}, target)
    return {}


def _bad_inputs(rank: int, world: int) -> dict[str, Any]:
    """Bad options fail on each rank alone: rank 1 tries them only after rank 0 has
    finished, and rank 0 before rank 1 reaches its first collective (any communication in
    the failed calls would pair with the barrier or wait for a peer and time out)."""
    from torch.distributed.device_mesh import init_device_mesh

    build, args, _, loss_fn, _ = _problem("mlp_residual")
    model = build()
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))  # made by all ranks
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    attempts: dict[str, dict[str, Any]] = {
        "schedule": {"schedule": "zigzag"},
        "num_stages": {"num_stages": world + 1},
        "interleaved": {"schedule": "interleaved1f1b"},
        "per_rank": {"schedule": "1f1b", "stages_per_rank": 2},
        "batch": {"n_microbatches": 3},
        "mesh_dims": {"mesh": flat},
        "mesh_type": {"mesh": [[0], [1]]},
        "data_parallel": {"mesh": mesh, "data_parallel": "zero3"},
        "mesh_and_group": {"mesh": mesh, "group": dist.group.WORLD},
        "mesh_stages": {"mesh": mesh, "num_stages": 3},
        "mesh_schedule": {"mesh": mesh, "schedule": "zbvzerobubble", "stages_per_rank": 2},
        "one_per_stage": {"schedule": "1f1b", "n_microbatches": 1},
        "rounds": {"schedule": "interleaved1f1b", "stages_per_rank": 2, "n_microbatches": 5},
    }
    if rank == 1:
        dist.barrier()
    errors: dict[str, Any] = {}
    for what, options in attempts.items():
        options.setdefault("n_microbatches", N_MB)
        try:
            fd.pipeline_schedule(model, args, loss_fn=loss_fn, **options)
            errors[what] = None
        except FxPipeError as e:
            errors[what] = (isinstance(e, ValueError), str(e))
    if rank == 0:
        dist.barrier()
    errors["untouched"] = all(not p.is_meta for p in model.parameters())
    return errors


def _disagree(rank: int, world: int) -> dict[str, Any]:
    """The ranks build different models; each must refuse, after the one collective."""
    _, args, _, loss_fn, _ = _problem("mlp_residual")
    model = ResidualMLP(depth=6 if rank == 0 else 5)
    try:
        fd.pipeline_schedule(model, args, n_microbatches=N_MB, loss_fn=loss_fn)
        error = ""
    except FxPipeError as e:
        error = str(e)
    return {"error": error, "untouched": all(not p.is_meta for p in model.parameters())}


# ---------------------------------------------------------------------------- launching


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, world: int, port: int, out: str, job: Callable[..., Any], options: dict[str, Any]
) -> None:
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pt"
    timeout = datetime.timedelta(seconds=options.pop("pg_timeout", 60))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    try:
        result = {"ok": job(rank, world, **options)}
    except BaseException as e:
        text = f"{type(e).__name__}: {e}"
        torch.save({"error": text, "traceback": traceback.format_exc()}, path)
        os._exit(1)  # no orderly shutdown: peers may be gone or blocked
    torch.save(result, path)
    dist.destroy_process_group()


#: Ranks start from a fork server that has imported torch, fxpipe and this module once, so
#: that each launch does not import them again in every rank (fork before any torch thread
#: or process group exists: the server only imports).
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "fxpipe.distributed", __name__])


def _launch(job: Callable[..., Any], world: int, tmp: Path, **options: Any) -> list[Any]:
    """Run ``job`` on ``world`` ranks; (exit code, saved result or None) per rank."""
    ctx = _CONTEXT
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, str(tmp), job, options), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIME_LIMIT
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if hung:
        pytest.fail(f"rank(s) {hung} still running after {TIME_LIMIT:.0f} s; killed")
    files = [tmp / f"rank{r}.pt" for r in range(world)]
    return [
        (p.exitcode, torch.load(f, weights_only=False) if f.exists() else None)
        for p, f in zip(procs, files)
    ]


def _results(runs: list[Any]) -> list[dict[str, Any]]:
    bad = [
        f"rank {r}: exit {code}\n{(res or {}).get('traceback', '')}"
        for r, (code, res) in enumerate(runs)
        if code != 0 or not res or "ok" not in res
    ]
    if bad:
        pytest.fail("\n".join(bad))
    return [res["ok"] for _, res in runs]


# ---------------------------------------------------------------------------- checks


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual, expected, rtol=1e-4, atol=1e-5 * max(scale, 1.0), msg=lambda m: f"{what}: {m}"
    )


def _check_against_eager(
    name: str, results: list[dict[str, Any]], divide: int = 1, replicas: int = 1
) -> None:
    """Losses and gradients against the eager model on the whole (global) batch. With
    ``replicas``, each replica's sum-reduced loss covers its slice of the batch, and the
    replicas average their gradients: each equals the eager one over ``replicas``."""
    eager, loss = _eager(name, replicas * BATCH)
    rank_losses = [r["loss"] for r in results if r["loss"] is not None]
    assert len(rank_losses) == replicas
    assert sum(rank_losses) == pytest.approx(loss, rel=1e-5)
    divide *= replicas
    for replica in range(replicas):
        _check_replica(eager, [r for r in results if r.get("replica", 0) == replica], divide)
    # The shards merge into a state dict that loads (strict) into the unpipelined model,
    # equal to the eager model after the same SGD step (every replica's shards alike).
    build, args, kwargs, _, _ = _problem(name, replicas * BATCH)
    with torch.no_grad():
        for p in eager.parameters():
            if p.grad is not None:  # a router behind an argmax has none
                p -= 0.01 * p.grad / divide
    for replica in range(replicas):
        fresh = build()
        shards = (r["shard"] for r in results if r.get("replica", 0) == replica)
        fresh.load_state_dict(fd.merge_state_dicts(shards), strict=True)
        with torch.no_grad():
            pairs = zip(tree_leaves(fresh(*args, **kwargs)), tree_leaves(eager(*args, **kwargs)))
            for a, b in pairs:
                _close(a, b, f"output of replica {replica}'s merged state dict")


def _check_replica(eager: nn.Module, results: list[dict[str, Any]], divide: int) -> None:
    """Every gradient of one replica's ranks is eager's over ``divide``, each once."""
    expected = {k: p.grad for k, p in eager.named_parameters()}
    got: dict[str, torch.Tensor] = {}
    for r in results:
        assert r["not_released"] == [], f"stages {r['stages']} kept {r['not_released']}"
        for key, grad in r["grads"].items():
            _close(grad, expected[key] / divide, f"grad of {key} on stages {r['stages']}")
            got[key] = grad
    assert set(got) == {k for k, p in eager.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_two_ranks_match_eager(tmp_path: Path) -> None:
    """Long skips (unet) under GPipe and 1F1B, dict inputs and outputs, a Llama decoder."""
    cases = [("unet", "gpipe", 1), ("unet", "1f1b", 1), ("multi_io_dict", "1f1b", 1)]
    cases.append(("llama", "1f1b", 1))
    runs = _launch(_train_cases, 2, tmp_path, cases=cases)
    for (name, _, _), *results in zip(cases, *_results(runs)):
        assert [r["stages"] for r in results] == [(0,), (1,)], name
        _check_against_eager(name, results)


#: (model, schedule, stages per rank): long skips (unet) and a tied embedding (transformer),
#: under GPipe, 1F1B and looped BFS (breadth-first, two stages per rank); interleaved 1F1B
#: with the skips.
MESH_CASES = [
    (name, schedule, spr)
    for name in ("unet", "transformer")
    for schedule, spr in (("gpipe", 1), ("1f1b", 1), ("loopedbfs", 2))
] + [
    ("unet", "interleaved1f1b", 2),
    ("shared_module", "loopedbfs", 2),
    ("weight_for_dtype", "gpipe", 1),
]
#: Zero-bubble schedules (backward split into input and weight parts), FSDP only: the
#: V-shaped ZBV and DualPipeV (stages r and 3 - r on rank r: the tied embedding and head
#: both on rank 0) and interleaved zero bubble; routed_experts sends gates gathered from a
#: Parameter alone out of stage 2; shared_offsets adds one Parameter to each block's own
#: (torch's split backward grouped them so that their gradients counted several times).
ZERO_BUBBLE_CASES = [
    ("unet", "zbvzerobubble", 2),
    ("unet", "dualpipev", 2),
    ("transformer", "interleavedzerobubble", 2),
    ("transformer", "zbvzerobubble", 2),
    ("routed_experts", "zbvzerobubble", 2),
    ("shared_offsets", "zbvzerobubble", 2),
]
#: Under FSDP, the Parameters left whole (read by two stages of one rank), by case and
#: the rank's stages: the tied embedding on ZBV's rank 0, the block called at two depths.
WHOLE = {
    ("transformer", "zbvzerobubble"): {(0, 3): ["tok.weight"]},
    ("shared_offsets", "zbvzerobubble"): {(0, 3): ["shared"], (1, 2): ["shared"]},
    ("shared_module", "loopedbfs"): {
        (0, 2): [f"shared.{m}.{p}" for m in ("fc1", "fc2", "norm") for p in ("bias", "weight")]
    },
}


def _local_conv_tokens() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """LocalConvTokens (same weights each call), a batch of ``N_MB`` images, a target."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LocalConvTokens()
    x = torch.randn(N_MB, 3, 8, 8, generator=_gen())
    return model, x, torch.randn(N_MB, 5, generator=_gen())


def _strided_boundaries(
    rank: int, world: int, *, schedules: list[tuple[str, int]]
) -> list[dict[str, Any]]:
    """For each (schedule, stages per rank): one step of LocalConvTokens in one-sample
    micro-batches; the loss, the gradients, and whether a stage receives a value whose
    layout is not a contiguous tensor's."""
    out = []
    for schedule, spr in schedules:
        model, x, target = _local_conv_tokens()
        pipe = fd.pipeline_schedule(
            model, x, schedule=schedule, n_microbatches=N_MB, loss_fn=_sum_sq, stages_per_rank=spr,
            scale_grads=False,
        )  # fmt: skip
        losses = _step(pipe, (x,), {}, target)
        # a permuted layout: strides not in decreasing order
        received = [s for j, layouts in enumerate(pipe._layouts or ()) if j > 0 for s in layouts]
        strided = any(list(s) != sorted(s, reverse=True) for s in received)
        out.append(
            {
                "loss": float(sum(losses)) if losses else None,
                "grads": {k: p.grad.clone() for k, p in pipe.named_parameters()},
                "strided": strided,
            }
        )
    return out


def _train_cases(
    rank: int, world: int, *, cases: list[tuple[str, str, int]], **options: Any
) -> list[dict[str, Any]]:
    """:func:`_train` for each case in turn, in one launch of the ranks."""
    return [
        _train(rank, world, name=name, schedule=schedule, spr=spr, **options)
        for name, schedule, spr in cases
    ]


@pytest.mark.parametrize("data_parallel", sweep(["fsdp", "ddp"]))
def test_two_stages_by_two_replicas_match_eager_on_the_global_batch(
    tmp_path: Path, data_parallel: str
) -> None:
    """A 2 x 2 mesh: two pipeline replicas (DDP, or FSDP2 shards, over "dp"), each fed half
    the batch, for every case of MESH_CASES (and, with FSDP, ZERO_BUBBLE_CASES): losses and
    every gradient equal eager's."""
    cases = MESH_CASES + (ZERO_BUBBLE_CASES if data_parallel == "fsdp" else [])
    runs = _launch(_train_cases, 4, tmp_path, cases=cases, dp=2, data_parallel=data_parallel)
    for case, *per_case in zip(cases, *_results(runs), strict=True):
        name, schedule, spr = case
        results = list(per_case)
        per_rank = [tuple(range(j, 2 * spr, 2)) for j in range(2)]
        if schedule in ("zbvzerobubble", "dualpipev"):
            per_rank = [(0, 3), (1, 2)]
        stages = [per_rank[0], per_rank[0], per_rank[1], per_rank[1]]
        assert [r["stages"] for r in results] == stages, case
        assert [r["replica"] for r in results] == [0, 1, 0, 1], case
        for r in results:  # FSDP: every parameter a DTensor shard but those left whole
            own = sorted(set(r["grads"]) | set(r["sharded"]))
            whole = WHOLE.get((name, schedule), {}).get(r["stages"], [])
            sharded = sorted(set(own) - set(whole)) if data_parallel == "fsdp" else []
            assert r["sharded"] == sharded, (case, r["stages"])
            assert r["view_warnings"] == [], (case, r["view_warnings"][:1])
        _check_against_eager(name, results, replicas=2)


@pytest.mark.parametrize(
    "data_parallel, schedule",
    sweep([("fsdp", "1f1b"), ("ddp", "1f1b"), ("fsdp", "zbvzerobubble")]),
)
def test_a_checkpoint_saved_at_two_by_two_resumes_at_four_by_one_and_in_eager(
    tmp_path: Path, data_parallel: str, schedule: str
) -> None:
    """torch.distributed.checkpoint writes one checkpoint for a 2 x 2 job (DDP: each replica
    holds every tensor; FSDP: each holds half of each, as DTensor shards, but the tied
    weight ZBV leaves whole on rank 0); a 4 x 1 job and the unpipelined model read it back
    with identical tensors, and training resumes with the losses of an uninterrupted eager
    run (the optimizer's momentum included)."""
    import torch.distributed.checkpoint as dcp

    folder, other = tmp_path / "checkpoint", tmp_path / "other"
    dcp.save({"model": ResidualMLP().state_dict()}, checkpoint_id=str(other))
    runs = _launch(
        _resume, 4, tmp_path, folder=str(folder), other=str(other),
        data_parallel=data_parallel, schedule=schedule,
    )  # fmt: skip
    results = _results(runs)
    for r in results:  # another model's checkpoint, and none at all: refused by each rank
        assert len(r["refused"]) == 2, r["refused"]
        assert "does not match stage(s)" in r["refused"][0] and "it lacks" in r["refused"][0]
        assert "not a torch.distributed.checkpoint folder" in r["refused"][1]
    _, args, _, _, target = _problem("transformer", 2 * BATCH)
    eager = _tiny_gpt()
    optimizer = _optimizer(eager.parameters())
    losses = []
    after_first: dict[str, torch.Tensor] = {}
    for _ in range(3):
        optimizer.zero_grad()
        loss = _lm_mean(eager(*args), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        after_first = after_first or {k: v.clone() for k, v in eager.state_dict().items()}
    replicas = [r["losses"][0] for r in results if r["losses"][0] == r["losses"][0]]
    assert len(replicas) == 2  # each replica's mean loss: their mean is the global one
    assert sum(replicas) / 2 == pytest.approx(losses[0], rel=1e-5)
    saved = fd.merge_state_dicts(r["shard"] for r in results if "shard" in r)
    loaded = fd.merge_state_dicts(r["loaded"] for r in results)
    assert saved.keys() == loaded.keys() == _tiny_gpt().state_dict().keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
        if value.is_floating_point():
            _close(value, after_first[key], f"{key} after one step")
        else:
            assert torch.equal(value, after_first[key]), key
    resumed = [r["resumed"] for r in results if r["resumed"][0] == r["resumed"][0]]
    assert len(resumed) == 1 and resumed[0] == pytest.approx(losses[1:], rel=1e-4)
    fresh = _tiny_gpt()
    state = fresh.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(folder))  # one process: the eager model
    for key, value in saved.items():
        assert torch.equal(state[key], value), key


@pytest.mark.slow
def test_a_strided_boundary_value_gets_its_gradient_in_its_own_layout(tmp_path: Path) -> None:
    """Each LocalConvTokens block hands the next a strided view; with one-sample micro-
    batches torch sent it, and sent its gradient back, contiguous, and the sending stage's
    BatchNorm backward gave wrong gradients on that layout (TinyViT: gradients of the
    first stage off by their own size, loss equal). Against eager run one micro-batch at a
    time (BatchNorm in training mode normalises each), for a whole backward and a split one
    (zero bubble hands out copies)."""
    schedules = [("gpipe", 1), ("zbvzerobubble", 2)]
    runs = _launch(_strided_boundaries, 2, tmp_path, schedules=schedules)
    model, x, target = _local_conv_tokens()
    loss = sum(_sum_sq(model(x[i : i + 1]), target[i : i + 1]) for i in range(N_MB))
    loss.backward()
    for (schedule, _), *results in zip(schedules, *_results(runs), strict=True):
        assert any(r["strided"] for r in results), schedule  # the case is still exercised
        assert sum(r["loss"] for r in results if r["loss"] is not None) == pytest.approx(
            loss.item(), rel=1e-5
        )
        got = {k: g for r in results for k, g in r["grads"].items()}
        assert set(got) == {k for k, _ in model.named_parameters()}
        for key, p in model.named_parameters():
            _close(got[key], p.grad, f"{schedule}: grad of {key}")


@pytest.mark.slow
def test_four_ranks_match_eager(tmp_path: Path) -> None:
    results = _results(_launch(_train, 4, tmp_path, name="unet", schedule="1f1b"))
    assert [r["stages"] for r in results] == [(0,), (1,), (2,), (3,)]
    _check_against_eager("unet", results)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, stages",
    [
        ("interleaved1f1b", [(0, 2), (1, 3)]),
        ("zbvzerobubble", [(0, 3), (1, 2)]),
        ("dualpipev", [(0, 3), (1, 2)]),
    ],
)
def test_two_stages_per_rank(tmp_path: Path, schedule: str, stages: list[Any]) -> None:
    runs = _launch(_train, 2, tmp_path, name="unet", schedule=schedule, spr=2, scale_grads=True)
    results = _results(runs)
    assert [r["stages"] for r in results] == stages
    _check_against_eager("unet", results, divide=N_MB)


@pytest.mark.slow
def test_zero_bubble_sends_a_stage_output_that_is_transposed(tmp_path: Path) -> None:
    """A stage of the Llama-shaped zoo model ends on a transposed tensor; under zero bubble the
    stage hands out copies, which kept its strides, and gloo refuses to send them ("input
    tensor has to be contiguous") until the copies were made contiguous."""
    runs = _launch(_train, 2, tmp_path, name="llama", schedule="interleavedzerobubble", spr=2)
    _check_against_eager("llama", _results(runs))


@pytest.mark.slow
def test_a_tied_embedding_is_held_by_each_rank_using_it_and_summed_once(
    tmp_path: Path,
) -> None:
    """The embedding and the LM head share one weight: each of the two ranks holds its own
    copy (nothing sent with the micro-batches), and sync_tied_gradients sums the copies'
    gradients once per step into eager's."""
    results = _results(_launch(_train, 2, tmp_path, name="transformer", schedule="1f1b"))
    _check_against_eager("transformer", results)
    holders = [r for r in results if "tok.weight" in r["grads"]]
    assert len(holders) == 2, "each rank reading the tied weight holds it"
    assert all({"tok.weight", "head.weight"} <= set(r["shard"]) for r in holders)
    assert all(r["replicated"] == ("tok.weight",) for r in results)
    assert all(r["sent_attrs"] == [] for r in results)  # no weight crosses a border


@pytest.mark.slow
def test_a_tied_weights_summed_copies_have_eagers_bits_at_one_micro_batch(
    tmp_path: Path,
) -> None:
    """The copies' gradients summed once per step are the eager gradient to the bit when
    the step is one micro-batch (eager's autograd adds the same two terms); with several,
    no gradient (tied or not) is: each is a sum over micro-batches, rounded otherwise than
    the whole batch's (the other tests compare those within float32 rounding)."""
    runs = _results(_launch(_bits, 2, tmp_path, name="transformer", n_mbs=(1, N_MB)))
    for n_mb, exact in ((1, True), (N_MB, False)):
        results = [r[n_mb] for r in runs]
        assert all(r["replicated"] == ("tok.weight",) for r in results)
        equal = {k: v for r in results for k, v in r["equal"].items()}
        assert len(equal) > 10 and "tok.weight" in equal
        if exact:
            assert all(equal.values()), [k for k, v in equal.items() if not v]
        else:
            assert not all(equal.values()), "micro-batched sums round otherwise"


@pytest.mark.slow
def test_what_splitting_the_batch_changes_is_refused_or_warned_on_every_rank(
    tmp_path: Path,
) -> None:
    for r in _results(_launch(_batch_checks, 2, tmp_path)):
        assert "n_microbatches=4" in r["refused"] and "reshape" in r["refused"], r["refused"]
        assert "pass n_microbatches=1" in r["refused"] and r["untouched"]
        assert r["train"] == [1, 0] and r["eval"] == [0, 0], (r["train"], r["eval"])
        assert "BatchNorm" in r["train_text"] and "pass n_microbatches=1" in r["train_text"]
        assert "deferred_batch_norm" not in r["train_text"]  # not an option here


@pytest.mark.slow
@pytest.mark.parametrize("dp, schedule", sweep([(1, "gpipe"), (2, "gpipe"), (2, "zbvzerobubble")]))
def test_an_update_without_summing_tied_gradients_is_refused_at_the_next_step(
    tmp_path: Path, dp: int, schedule: str
) -> None:
    """Forgetting sync_tied_gradients would leave each rank's copy of the tied embedding
    updated with its own share of the gradient (or, left whole by FSDP, each replica's
    with its own), the copies differing from then on."""
    runs = _results(_launch(_forgotten_sum, 2 * dp, tmp_path, dp=dp, schedule=schedule))
    holders = [r["refused"] for r in runs if r["refused"] is not None]
    assert len(holders) == (dp if schedule == "zbvzerobubble" else 2 * dp)
    for refused in holders:
        assert "['tok.weight']" in refused and "sync_tied_gradients()" in refused


@pytest.mark.slow
def test_module_called_in_two_stages_is_held_by_both_ranks(tmp_path: Path) -> None:
    results = _results(_launch(_train, 2, tmp_path, name="shared_module", schedule="gpipe"))
    assert all(r["stages_using_shared"] == {0, 1} for r in results)
    assert all("shared.fc1.weight" in r["replicated"] for r in results)
    holders = [r for r in results if "shared.fc1.weight" in r["grads"]]
    assert len(holders) == 2
    _check_against_eager("shared_module", results)


@pytest.mark.slow
def test_sync_tied_gradients_sums_copies(tmp_path: Path) -> None:
    results = _results(_launch(_sync, 2, tmp_path))
    for r in results:
        assert torch.equal(r["both"], torch.full((3,), 3.0))
    assert torch.equal(results[0]["mine"], torch.ones(2, 2))


@pytest.mark.slow
@pytest.mark.parametrize("dp", sweep([1, 2]))
def test_meta_model_materialises_and_loads_its_stage(tmp_path: Path, dp: int) -> None:
    """On one pipeline, and (dp=2) on two FSDP replicas, each rank loading its shards."""
    results = _results(_launch(_meta_model, 2 * dp, tmp_path, dp=dp))
    eager, loss = _eager("mlp_residual", dp * BATCH)
    assert all(r["placed"] and r["released"] for r in results)
    assert all("lacks" in r["refused"] for r in results)
    assert all("never loaded" in r["unloaded"] for r in results)
    rank_losses = [r["loss"] for r in results if r["loss"] is not None]
    assert len(rank_losses) == dp and sum(rank_losses) == pytest.approx(loss, rel=1e-5)
    expected = dict(eager.named_parameters())
    for r in results:
        for key, grad in r["grads"].items():
            _close(grad, expected[key].grad / dp, key)
    fresh = ZOO["mlp_residual"].build().state_dict()
    for r in results:  # pipeline rank 0 of each replica (global ranks 0 .. dp - 1) merges
        merged = r["merged"]
        if r is results[0] or (dp > 1 and r is results[1]):
            ZOO["mlp_residual"].build().load_state_dict(merged, strict=True)
            for key, value in fresh.items():
                assert torch.equal(merged[key], value), key
        else:
            assert merged is None


@pytest.mark.slow
@pytest.mark.parametrize("what", ["batch", "constant"])
def test_inputs_unlike_the_examples_are_refused_before_anything_is_sent(
    tmp_path: Path, what: str
) -> None:
    """Without the checks, the last rank received into a buffer of the example's size and
    aborted (SIGABRT) on a larger batch; another constant was a RuntimeError of torch's.
    The first rank refuses the step and the other raises too, quoting it (no time-out)."""
    runs = _launch(_wrong_inputs, 2, tmp_path, pg_timeout=15, what=what)
    assert all(code != 0 for code, _ in runs), [code for code, _ in runs]
    first, second = (res["error"] for _, res in runs)
    assert first.startswith("InputError"), first
    assert second.startswith("InputError: the pipeline's first rank refused"), second
    if what == "batch":
        assert "argument x has shape (16, 32): a batch of 16 rows" in first, first
        assert "built for batches of 8 rows" in first, first
    else:
        assert "argument scale is 3.0 but the pipeline was traced with 2.0" in first, first
    assert first.removeprefix("InputError: ") in second, second


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, dp, data_parallel", sweep([(3, 1, "ddp"), (4, 2, "ddp"), (4, 2, "fsdp")])
)
def test_failing_rank_stops_every_rank(
    tmp_path: Path, world: int, dp: int, data_parallel: str
) -> None:
    start = time.monotonic()
    runs = _launch(
        _fail, world, tmp_path, bad_rank=1, pg_timeout=15, dp=dp, data_parallel=data_parallel
    )
    assert time.monotonic() - start < TIME_LIMIT
    assert all(code != 0 for code, _ in runs), [code for code, _ in runs]
    assert all(res is not None and "error" in res for _, res in runs)
    assert "injected failure on rank 1" in runs[1][1]["traceback"]


@pytest.mark.slow
def test_bad_options_fail_on_every_rank_before_communication(tmp_path: Path) -> None:
    for errors in _results(_launch(_bad_inputs, 2, tmp_path, pg_timeout=20)):
        assert errors.pop("untouched")
        assert all(e is not None and e[0] for e in errors.values()), errors
        assert "'zigzag'" in errors["schedule"][1] and "Interleaved1F1B" in errors["schedule"][1]
        assert "num_stages=3" in errors["num_stages"][1]
        assert "stages_per_rank=1" in errors["interleaved"][1]
        assert "stages_per_rank=2" in errors["per_rank"][1]
        assert "n_microbatches=3" in errors["batch"][1]
        assert "('pp', 'dp')" in errors["mesh_dims"][1] and "('dp',)" in errors["mesh_dims"][1]
        assert "not a torch DeviceMesh" in errors["mesh_type"][1]
        assert "data_parallel='zero3'" in errors["data_parallel"][1]
        assert "pass mesh alone" in errors["mesh_and_group"][1]
        assert "num_stages=3" in errors["mesh_stages"][1]
        assert "'pp'" in errors["mesh_stages"][1]
        assert "splits backward" in errors["mesh_schedule"][1]
        assert "data_parallel='fsdp'" in errors["mesh_schedule"][1]
        assert "n_microbatches=1 < 2 stages" in errors["one_per_stage"][1]
        assert "n_microbatches=4" in errors["rounds"][1] and "=5" in errors["rounds"][1]


@pytest.mark.slow
def test_ranks_that_plan_differently_all_refuse(tmp_path: Path) -> None:
    for result in _results(_launch(_disagree, 2, tmp_path, pg_timeout=20)):
        assert "rank(s) [1] computed a different plan" in result["error"]
        assert result["untouched"]


def test_one_process_per_stage_plans_a_tied_weight_held_by_each_stage_not_sent() -> None:
    """What pipeline_schedule plans (replicate_weights): the tied weight is in both stages'
    parameters and memory and on no border; the single-process plan sends it whole once
    per batch, and its summary counts it so."""
    from fxpipe.api import compile_model
    from fxpipe.options import PlanOptions

    args, kwargs = ZOO["transformer"].example(BATCH)
    weight = 64 * 32 * 4  # TinyGPT's vocab x width, float32
    plans = {}
    for replicate in (False, True):
        options = PlanOptions(cost="flops", chunks=N_MB, traffic="relay",
                              replicate_weights=replicate)  # fmt: skip
        plans[replicate] = compile_model(
            _tiny_gpt(), args, ["cpu", "cpu"], options, example_kwargs=kwargs, present=False
        ).plan
    sent, held = plans[False], plans[True]
    (edge,) = [e for e in sent.edges if e.value == "tok_weight"]
    assert edge.bytes == weight and edge.consumers == (1,)
    assert "tok_weight" not in {e.value for e in held.edges}
    assert all(s.param_bytes >= weight for s in held.stages)
    assert "replicated:  tok.weight (stages 0, 1)" in str(held)
    assert "replicated:" not in str(sent)
    (line,) = [line for line in str(sent).splitlines() if line.startswith("boundaries:")]
    activations = sum(e.bytes for e in sent.edges if e.value != "tok_weight")
    assert f"{fxpipe_bytes(weight + activations)} per batch" in line
    assert f"({fxpipe_bytes(activations / N_MB)} per micro-batch, " in line
    assert f"{fxpipe_bytes(weight)} of it once per batch" in line


def fxpipe_bytes(size: float) -> str:
    from fxpipe.views.report import format_bytes

    return format_bytes(size)


def test_without_a_process_group_names_the_remedy() -> None:
    assert not dist.is_initialized()
    build, args, _, loss_fn, _ = _problem("mlp_residual")
    with pytest.raises(ConfigError, match=r"init_process_group"):
        fd.pipeline_schedule(build(), args, n_microbatches=N_MB, loss_fn=loss_fn)


def test_fsdp_leaves_whole_a_parameter_read_by_two_stages_of_one_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fully_shard wraps each stage alone: a Parameter two stages of one rank read (a tied
    weight under a V or looped schedule) cannot be sharded for both, so it is left whole,
    on every rank; DDP, or one replica, shard nothing. A torch whose fully_shard cannot
    leave a Parameter out is refused, naming the stages."""
    from dataclasses import replace

    from fxpipe.distributed import mesh
    from fxpipe.distributed.mesh import Layout, check_sharding

    shared = nn.Linear(2, 2)
    both = {id(shared.weight), id(shared.bias)}
    stages = [nn.Sequential(shared), nn.Sequential(nn.Linear(2, 2)), nn.Sequential(shared)]
    fsdp = Layout(None, dp_group=object(), dp_size=2, data_parallel="fsdp")  # type: ignore[arg-type]
    assert check_sharding(fsdp, stages, (0, 1, 0)) == both
    assert check_sharding(fsdp, stages, (0, 1, 2)) == set()  # on two ranks: each its own
    # Read by stages 0, 1 and 3 on ranks 0, 1, 1: the two on rank 1 share it.
    four = [stages[0], nn.Sequential(shared), nn.Sequential(nn.Linear(2, 2)), stages[2]]
    assert check_sharding(fsdp, four, (0, 1, 0, 1)) == both
    assert check_sharding(replace(fsdp, data_parallel="ddp"), stages, (0, 1, 0)) == set()
    assert check_sharding(replace(fsdp, dp_group=None), stages, (0, 1, 0)) == set()
    monkeypatch.setattr(mesh, "can_leave_whole", lambda: False)
    with pytest.raises(ConfigError, match=r"stages 0 and 2, which are both on pipeline rank 0"):
        check_sharding(fsdp, stages, (0, 1, 0))
    with pytest.raises(ConfigError, match=r"stages 1 and 3, which are both on pipeline rank 1"):
        check_sharding(fsdp, four, (0, 1, 0, 1))
    with pytest.raises(ConfigError, match="data_parallel='ddp'"):
        check_sharding(fsdp, stages, (0, 1, 0))
    assert check_sharding(fsdp, stages, (0, 1, 2)) == set()


def test_zero_bubble_refuses_a_stage_whose_inputs_need_no_gradient() -> None:
    """torch starts a later stage's weight part from its inputs: a stage with Parameters
    and no input that needs a gradient would get none, so it is refused; a schedule with a
    whole backward, or an input that needs one, or frozen Parameters, is fine."""
    from types import SimpleNamespace

    from fxpipe.distributed.build import _check_weight_part

    def meta(dtype: torch.dtype, grad: bool) -> torch.Tensor:
        return torch.empty(2, 3, dtype=dtype, device="meta").requires_grad_(grad)

    program: Any = SimpleNamespace(modules=[nn.Linear(3, 3), nn.Linear(3, 3)])
    ids: Any = [((meta(torch.float32, True),), ()), ((torch.zeros(2, 3, dtype=torch.long),), ())]
    with pytest.raises(ConfigError, match=r"stage 1 trains Parameters \(weight, bias\)"):
        _check_weight_part("zbvzerobubble", program, ids)
    with pytest.raises(ConfigError, match="'1f1b'"):
        _check_weight_part("interleavedzerobubble", program, ids)
    _check_weight_part("1f1b", program, ids)
    floats = [ids[0], ((meta(torch.float32, False), meta(torch.float32, True)), ())]
    _check_weight_part("zbvzerobubble", program, floats)
    program.modules[1].requires_grad_(False)
    _check_weight_part("zbvzerobubble", program, ids)


def test_a_stage_without_parameters_is_not_wrapped_for_data_parallelism() -> None:
    """A stage of no Parameters (a split between Mixtral's layers left one with none) has
    nothing to average or shard: DDP would refuse it ("not needed when a module doesn't
    have any parameter"), so neither wraps it; a stage with Parameters is wrapped."""
    from dataclasses import replace

    from fxpipe.distributed.mesh import Layout

    ddp = Layout(None, dp_group=object(), dp_size=2, data_parallel="ddp")  # type: ignore[arg-type]
    bare = nn.Sequential(nn.ReLU())
    assert ddp.wrap(bare, torch.device("cpu")) is bare
    assert replace(ddp, data_parallel="fsdp").wrap(bare, torch.device("cpu")) is bare
    frozen = nn.Linear(2, 2).requires_grad_(False)
    assert ddp.wrap(frozen, torch.device("cpu")) is frozen
    with pytest.raises((AttributeError, TypeError, ValueError, RuntimeError)):
        ddp.wrap(nn.Linear(2, 2), torch.device("cpu"))  # wrapped: DDP reads the fake group


@pytest.mark.parametrize(
    "name, stages, idle",
    [
        ("weight_for_dtype", 2, (False, True)),
        ("mlp_residual", 3, (False, False, False)),
        ("transformer", 2, (False, False)),
    ],  # fmt: skip
)
def test_only_a_stage_holding_a_weight_it_reads_for_its_dtype_makes_ddp_search(
    name: str, stages: int, idle: tuple[bool, ...]
) -> None:
    """DDP searches each step for Parameters its stage gives no gradient only where the
    stage holds a trained one its outputs do not depend on (weight_for_dtype's last stage
    reads the first layer's weight for its dtype); elsewhere the search is skipped (and
    torch's warning that it found none)."""
    from fxpipe.api import compile_model
    from fxpipe.distributed.shapes import example_shapes
    from fxpipe.options import PlanOptions

    case = ZOO[name]
    model = case.build()
    args, kwargs = case.example(BATCH)
    options = PlanOptions(cost="flops", chunks=N_MB, traffic="relay", replicate_weights=True)
    compiled = compile_model(model, args, ["cpu"] * stages, options, example_kwargs=kwargs)
    values = compiled.traced.binder.bind(args, kwargs)
    assert example_shapes(model, compiled.program, values).idle == idle
