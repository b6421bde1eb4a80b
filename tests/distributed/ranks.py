"""What the tests of fxpipe.distributed share: ranks started on the CPU (gloo on loopback)
under a hard time limit, the problems they train, and the checks against eager PyTorch.

Each test starts its ranks with torch.multiprocessing (from a fork server), joins every one
of them under a hard time limit (killing the rest and failing past it), and reads what each
rank saved. A rank job is a function of a test module (or of this one), pickled by its
module's package path (``tests.distributed.test_build``), so the repository's root is put
on ``sys.path`` for the ranks to import it.
Losses are sum-reduced with ``scale_grads=False`` (passed explicitly: the default is True, as
in torch's schedules), so the summed micro-batch losses and the gradients equal the eager
model's on the whole batch (one test uses ``scale_grads=True`` and compares with the eager
gradients divided by the number of micro-batches).

Imported as ``tests.distributed.ranks``.
"""

from __future__ import annotations

import datetime
import os
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

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the ranks import the test modules by their package path
    sys.path.append(str(ROOT))

from models import ZOO, TinyGPT  # noqa: E402

import fxpipe.distributed as fd  # noqa: E402
from fxpipe.distributed.parallel.dtensors import full_tensor, is_dtensor  # noqa: E402

#: Seconds per launch, all ranks together: a hang detector. Eight ranks of three transformers
#: models take about 130 s alone on a slow 2-core machine, longer beside other tests.
TIME_LIMIT = 480.0
#: Seconds a rank waits for its peers at a collective, unless a test sets pg_timeout (the
#: failure tests do, to see a peer's error quickly): a rank compiling its stage, or one
#: starved of the cores, may keep the others waiting for more than a minute.
PG_TIMEOUT = 240.0
BATCH, N_MB = 8, 4

Problem = tuple[Callable[[], nn.Module], tuple[Any, ...], dict[str, Any], Callable[..., Any], Any]


# ---------------------------------------------------------------------------- problems


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def sum_sq(out: Any, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()


def _dict_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    assert isinstance(out, dict) and set(out) == {"logits", "aux"}, type(out)
    return ((out["logits"] - target) ** 2).sum() + (out["aux"] ** 2).sum()


def _lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten(), reduction="sum")


def _llama_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    assert isinstance(out, dict) and set(out) == {"logits", "last_hidden_state"}, type(out)
    return _lm_loss(out["logits"], target) + out["last_hidden_state"].square().sum()


def tiny_gpt() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TinyGPT(p=0.0)  # no dropout: the oracle is exact


def problem(name: str, batch: int = BATCH) -> Problem:
    """Model factory (same weights each call), example args and kwargs, loss, target."""
    if name == "transformer":
        args, kwargs = ZOO["transformer"].example(batch)
        target = torch.randint(0, 64, args[0].shape, generator=gen())
        return tiny_gpt, args, kwargs, _lm_loss, target
    case = ZOO[name]
    args, kwargs = case.example(batch)
    if name == "llama":
        target = torch.randint(0, 64, args[0].shape, generator=gen())
        return case.build, args, kwargs, _llama_loss, target
    out = case.build()(*args, **kwargs)
    logits = out["logits"] if isinstance(out, dict) else out
    target = torch.randn(logits.shape, generator=gen())
    return case.build, args, kwargs, _dict_loss if name == "multi_io_dict" else sum_sq, target


def eager(name: str, batch: int = BATCH) -> tuple[nn.Module, float]:
    build, args, kwargs, loss_fn, target = problem(name, batch)
    model = build()
    loss = loss_fn(model(*args, **kwargs), target)
    loss.backward()
    return model, loss.item()


# ---------------------------------------------------------------------------- rank jobs


def whole(t: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor: DTensors gathered (a collective over their mesh), FSDP's
    shards of a weight cut in parts as fxpipe gathers them (dtensors.py)."""
    return full_tensor(t) if is_dtensor(t) else t.clone()


def step(pipe: fd.DistributedPipeline, args: Any, kwargs: Any, target: Any) -> list[Any]:
    losses: list[Any] = []
    if pipe.is_first:
        tgt = target if pipe.is_last else None
        pipe.schedule.step(*args, target=tgt, losses=losses, **kwargs)
    elif pipe.is_last:
        pipe.schedule.step(target=target, losses=losses)
    else:
        pipe.schedule.step()
    return losses


def train(
    rank: int,
    world: int,
    *,
    name: str,
    schedule: str,
    spr: int = 1,
    scale_grads: bool = False,
    dp: int = 1,
    data_parallel: str = "ddp",
    compile: Any = False,
    n_mb: Any = N_MB,
    tp: int = 1,
) -> dict[str, Any]:
    """One pipelined step, then one SGD step; gradients and the state-dict shard (whole
    tensors, gathered from FSDP's shards). With ``dp > 1``: a (world / dp) x dp mesh,
    replica ``i`` taking the i-th slice of a global batch of ``dp * BATCH``. ``compile``:
    pipeline_schedule's (what compiling each stage came to is returned too); ``n_mb``:
    its ``n_microbatches`` (the schedule and count it ran with are returned). With ``tp > 1``:
    a (world / (dp * tp)) x dp x tp mesh and ``tensor_parallel="auto"`` (the batch sliced
    by replica alike)."""
    build, args, kwargs, loss_fn, target = problem(name, dp * BATCH)
    model = build()
    mesh, replica, tp_rank = None, 0, 0
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        shape = (world // (dp * tp), dp, tp)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
        tp_rank = mesh.get_local_rank("tp")
    elif dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
    if dp > 1:
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
        n_microbatches=n_mb,
        loss_fn=loss_fn,
        stages_per_rank=spr,
        scale_grads=scale_grads,
        mesh=mesh,
        data_parallel=data_parallel,
        compile=compile,
        tensor_parallel="auto" if tp > 1 else None,
    )
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = step(pipe, args, kwargs, target)
    pipe.sync_tied_gradients()
    own = dict(pipe.named_parameters())
    sharded = sorted(k for k, p in own.items() if is_dtensor(p))
    grads = {k: whole(p.grad) for k, p in own.items() if p.grad is not None}
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
        "tp_rank": tp_rank,
        "loss": float(sum(losses)) if losses else None,
        "grads": grads,
        "shard": {k: whole(v) for k, v in pipe.state_dict().items()},
        "sharded": sharded,
        "replicated": pipe.replicated_keys,
        "sent_attrs": [e.value for e in pipe.plan.edges if e.value in attrs],
        "not_released": kept,
        "stages_using_shared": shared,
        # FSDP warns when a wrapped stage returns a view (its backward hook could be lost)
        "view_warnings": [str(w.message) for w in caught if "view" in str(w.message)],
        "compiled": [(c.compiled, c.graphs) for c in pipe.compilation],
        # what the stages were balanced by: under tensor parallelism, one "tp" rank's costs
        "node_costs": {n: c.cost for n, c in pipe.plan.costs.nodes.items()},
        "cut_styles": {} if pipe.tensor_plan is None else dict(pipe.tensor_plan.node_styles),
        "ran": (pipe.options.schedule, pipe.options.n_microbatches, pipe.options.stages_per_rank),
        "chosen_from": None if pipe.schedule_choice is None else len(pipe.schedule_choice.weighed),
    }


def train_cases(
    rank: int, world: int, *, cases: list[tuple[str, str, int]], **options: Any
) -> list[dict[str, Any]]:
    """:func:`train` for each case in turn, in one launch of the ranks."""
    return [
        train(rank, world, name=name, schedule=schedule, spr=spr, **options)
        for name, schedule, spr in cases
    ]


# ---------------------------------------------------------------------------- launching


def _entry(
    rank: int, world: int, port: int, out: str, job: Callable[..., Any], options: dict[str, Any]
) -> None:
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pt"
    timeout = datetime.timedelta(seconds=options.pop("pg_timeout", PG_TIMEOUT))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        result = {"ok": job(rank, world, **options)}
    except BaseException as e:
        text = f"{type(e).__name__}: {e}"
        torch.save({"error": text, "traceback": traceback.format_exc()}, path)
        os._exit(1)  # no orderly shutdown: peers may be gone or blocked
    torch.save(result, path)
    dist.destroy_process_group()


#: Ranks start from a fork server that has imported torch, fxpipe, this module and the test
#: modules that launch ranks once (each names itself with :func:`preload` when imported,
#: before the first launch starts the server), so that each launch does not import them
#: again in every rank (fork before any torch thread or process group exists: the server
#: only imports).
_CONTEXT = mp.get_context("forkserver")
_PRELOAD = ["torch", "torch.distributed", "fxpipe.distributed", __name__]
_CONTEXT.set_forkserver_preload(_PRELOAD)


def preload(module: str) -> None:
    """Have the fork server import ``module`` (a test module's ``__name__``) once."""
    if module not in _PRELOAD:
        _PRELOAD.append(module)
        _CONTEXT.set_forkserver_preload(_PRELOAD)


def launch(job: Callable[..., Any], world: int, tmp: Path, **options: Any) -> list[Any]:
    """Run ``job`` on ``world`` ranks; (exit code, saved result or None) per rank."""
    ctx = _CONTEXT
    # the launcher holds the ranks' store, on a port the system picks as it binds it: no
    # port is chosen, let go and bound again, which tests run side by side (pytest -n) race
    # for
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = master.port
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
    del master  # the ranks are gone
    if hung:
        pytest.fail(f"rank(s) {hung} still running after {TIME_LIMIT:.0f} s; killed")
    files = [tmp / f"rank{r}.pt" for r in range(world)]
    return [
        (p.exitcode, torch.load(f, weights_only=False) if f.exists() else None)
        for p, f in zip(procs, files)
    ]


def results(runs: list[Any]) -> list[dict[str, Any]]:
    bad = [
        f"rank {r}: exit {code}\n{(res or {}).get('traceback', '')}"
        for r, (code, res) in enumerate(runs)
        if code != 0 or not res or "ok" not in res
    ]
    if bad:
        pytest.fail("\n".join(bad))
    return [res["ok"] for _, res in runs]


# ---------------------------------------------------------------------------- checks


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual, expected, rtol=1e-4, atol=1e-5 * max(scale, 1.0), msg=lambda m: f"{what}: {m}"
    )


def check_against_eager(
    name: str, results: list[dict[str, Any]], divide: int = 1, replicas: int = 1
) -> None:
    """Losses and gradients against the eager model on the whole (global) batch. With
    ``replicas``, each replica's sum-reduced loss covers its slice of the batch, and the
    replicas average their gradients: each equals the eager one over ``replicas``."""
    model, loss = eager(name, replicas * BATCH)
    rank_losses = [r["loss"] for r in results if r["loss"] is not None]
    assert len(rank_losses) == replicas
    assert sum(rank_losses) == pytest.approx(loss, rel=1e-5)
    divide *= replicas
    for replica in range(replicas):
        _check_replica(model, [r for r in results if r.get("replica", 0) == replica], divide)
    # The shards merge into a state dict that loads (strict) into the unpipelined model,
    # equal to the eager model after the same SGD step (every replica's shards alike).
    build, args, kwargs, _, _ = problem(name, replicas * BATCH)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:  # a router behind an argmax has none
                p -= 0.01 * p.grad / divide
    for replica in range(replicas):
        fresh = build()
        shards = (r["shard"] for r in results if r.get("replica", 0) == replica)
        fresh.load_state_dict(fd.merge_state_dicts(shards), strict=True)
        with torch.no_grad():
            pairs = zip(tree_leaves(fresh(*args, **kwargs)), tree_leaves(model(*args, **kwargs)))
            for a, b in pairs:
                close(a, b, f"output of replica {replica}'s merged state dict")


def _check_replica(model: nn.Module, results: list[dict[str, Any]], divide: int) -> None:
    """Every gradient of one replica's ranks is eager's over ``divide``, each once."""
    expected = {k: p.grad for k, p in model.named_parameters()}
    got: dict[str, torch.Tensor] = {}
    for r in results:
        assert r["not_released"] == [], f"stages {r['stages']} kept {r['not_released']}"
        for key, grad in r["grads"].items():
            close(grad, expected[key] / divide, f"grad of {key} on stages {r['stages']}")
            got[key] = grad
    assert set(got) == {k for k, p in model.named_parameters() if p.grad is not None}
