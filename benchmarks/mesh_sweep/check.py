"""One (model, configuration, dtype) of the mesh sweep: its launch, what went wrong in it if
anything did, and its steps judged against the (cached) eager oracles."""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.compare import TOLERANCE
from benchmarks.harness.failures import first_line
from benchmarks.harness.models.registry import registry
from benchmarks.harness.rows import Row
from benchmarks.mesh_sweep.batch import DTYPES, prepared
from benchmarks.mesh_sweep.configs import Config
from benchmarks.mesh_sweep.judge import copies, judge_exact, judge_narrow, step_noise
from benchmarks.mesh_sweep.oracle import Trajectory, trajectory
from benchmarks.mesh_sweep.ranks import launch

__all__ = ["Oracles", "check", "triage", "judged"]

#: What a rank whose peer died reports (gloo over TCP): not the cause.
_SYMPTOM = "Connection reset by peer"
#: A step's classes, the worst first: a row is its worst step's (skipped only when all are).
_WORST = ("wrong", "crashed", "timeout", "refused", "equal", "skipped")
#: A float64 row wrong by less than this (100 float32 epsilons), where eager itself computes
#: in float32, says so: its error may be float32's rounding of that work on another layout.
ROUNDING = 100 * torch.finfo(torch.float32).eps
#: Such a row is equal where each kind's error is within this many times eager's own
#: difference between micro-batches and whole replicas (the model sweep's rule).
NOISE_FACTOR = 10
#: One model's eager trajectories, by (rows, micro-batches, replicas, lengths, dtype).
Oracles = dict[tuple[Any, ...], Trajectory]


def _oracle(name: str, config: Config, dtype: torch.dtype, oracles: Oracles) -> Trajectory:
    key = (config.rows, config.n_microbatches, config.dp, config.lengths, dtype)
    if key not in oracles:
        try:
            oracles[key] = trajectory(name, config, dtype)
        except Exception as exc:
            oracles[key] = Trajectory(dtype, [f"eager failed: {first_line(repr(exc))}"])
    return oracles[key]


def _batch_note(name: str, config: Config, row: Row) -> Row | None:
    """The row's batch, said (``batch``, ``rows``); a skipped row where the model cannot be
    built or its batch does not split between the replicas."""
    try:
        have = prepared(name, config).example_rows
    except Exception as exc:
        return {**row, "status": "skipped", "reason": f"build failed: {first_line(repr(exc))}"}
    want = config.dp * config.n_microbatches
    if config.rows:
        row["rows"] = f"{config.dp} x {config.rows}"
    elif have < want:  # the example batch is repeated (prepared widens it); said in the row
        row["batch"] = f"{have} repeated to {want}"
    elif have % config.dp:
        reason = f"batch {have} does not split in {config.dp}"
        return {**row, "status": "skipped", "reason": reason}
    return None


def check(
    name: str, config: Config, dtype: str, timeout: float, oracles: Oracles, pg: float
) -> Row:
    """One (model, configuration, dtype): launched, then each step judged."""
    row: Row = {"name": name, "family": registry()[name].family, "config": config.name,
                "dtype": dtype}  # fmt: skip
    started = time.perf_counter()
    skipped = _batch_note(name, config, row)
    if skipped:
        return skipped
    eager = _oracle(name, config, DTYPES[dtype], oracles)
    reference = _oracle(name, config, torch.float64, oracles)
    if isinstance(eager.steps[0], str):
        return {**row, "status": "skipped", "reason": eager.steps[0]}
    with tempfile.TemporaryDirectory() as tmp:
        runs, timed_out = launch(name, config, DTYPES[dtype], timeout, Path(tmp), pg)
    row["seconds"] = round(time.perf_counter() - started, 1)
    failed = triage(runs, timed_out, timeout)
    if failed:
        return {**row, **failed}
    ranks = [res["ok"] for _, res in runs]
    eager, reference = _restarted(name, config, ranks, eager, reference)
    row.update(judged(ranks, config, eager, reference))
    worst = max(row.get("max_err", {}).values(), default=float("inf"))
    if row["status"] == "wrong" and eager.narrow and worst < ROUNDING:
        row["float32_ops"] = sum(eager.narrow.values())
        row["noise"] = noise = _noise(name, config, oracles)
        bound = {k: max(TOLERANCE, NOISE_FACTOR * noise.get(k, 0.0)) for k in row["max_err"]}
        if all(v <= bound[k] for k, v in row["max_err"].items()):
            row["status"], row["reason"] = "equal", ""
        else:
            row["reason"] += f" ({_narrow_note(eager.narrow)})"
    return row


def _noise(name: str, config: Config, oracles: Oracles) -> dict[str, float]:
    """Eager in float64 on the configuration's micro-batches against eager on each replica's
    rows at once, per kind, the largest over the steps: the rounding a float64 model's own
    float32 work gives a sum split otherwise (as the tensor-parallel ranks split it)."""
    split = _oracle(name, config, torch.float64, oracles)
    whole = _oracle(name, dataclasses.replace(config, n_microbatches=1), torch.float64, oracles)
    noise: dict[str, float] = {}
    for one, other in zip(split.steps, whole.steps):
        if isinstance(one, str) or isinstance(other, str):
            break
        for kind, err in step_noise(one, other).items():
            noise[kind] = max(noise.get(kind, 0.0), err)
    return noise


def _narrow_note(ops: dict[str, int]) -> str:
    """What a float64 model computes in float32 itself, said beside a wrong row's reason."""
    names = sorted(ops, key=ops.__getitem__, reverse=True)[:4]
    return f"eager computes {sum(ops.values())} ops in float32: {', '.join(names)}"


def _restarted(
    name: str, config: Config, ranks: list[Row], eager: Trajectory, reference: Trajectory
) -> tuple[Trajectory, Trajectory]:
    """The oracles again, each step after the first from the parameters the pipeline held
    after its step before (its first copy's, already judged against eager's update)."""
    ran = min(len(r["steps"]) for r in ranks)
    first = reference.steps[0]
    if ran < 2 or isinstance(first, str):
        return eager, reference
    starts = {}
    for s in range(1, ran):
        if any("refused" in r["steps"][s - 1] for r in ranks):
            break
        starts[s] = next(copies(ranks, s - 1, first))[2]
    if not starts:
        return eager, reference
    again = trajectory(name, config, eager.dtype, starts)
    if eager.dtype == torch.float64:
        return Trajectory(again.dtype, again.steps, reference.narrow), again
    return again, trajectory(name, config, torch.float64, starts)


def triage(runs: list[Any], timed_out: bool, timeout: float) -> Row | None:
    """A launch that did not end with a result on every rank: timeout, crashed (the cause
    first: a peer's lost connection is a symptom) or refused (on every rank, else crashed)."""
    if timed_out and all(res is None for _, res in runs):
        return {"status": "timeout", "reason": f"no rank done after {timeout:.0f} s"}
    codes = [code for code, _ in runs]
    died = [r for r, (code, res) in enumerate(runs) if res is None and code not in (0, None)]
    errors = sorted(
        ((r, res) for r, (_, res) in enumerate(runs) if res and "error" in res),
        key=lambda item: _SYMPTOM in item[1]["error"],
    )
    if errors or died:
        dead = f"rank(s) {died} died without a word (exit codes {codes}); " if died else ""
        r, res = errors[0] if errors else (died[0], {"error": "", "traceback": ""})
        at = f" (in {res['phase']})" if res.get("phase") else ""
        line = first_line(res["error"], 300)
        return {"status": "crashed", "reason": f"{dead}rank {r}{at}: {line}",
                "traceback": res["traceback"][-3000:]}  # fmt: skip
    refused = {res["refused"] for _, res in runs if res and "refused" in res}
    if refused:
        whole = len(refused) == 1 and all(res and "refused" in res for _, res in runs)
        status = "refused" if whole else "crashed"
        reason = sorted(refused)[0] if whole else f"refused on some ranks only: {sorted(refused)}"
        return {"status": status, "reason": first_line(reason, 300)}
    if timed_out or any(code != 0 or not res for code, res in runs):
        return {"status": "timeout" if timed_out else "crashed",
                "reason": f"ranks ended without a result (exit codes {codes})"}  # fmt: skip
    return None


def _judge_step(
    ranks: list[Row], s: int, config: Config, eager: Trajectory, reference: Trajectory
) -> Row:
    """Step ``s`` (from 0): refused (on every rank), skipped (eager failed or is not finite
    there) or judged."""
    said = [r["steps"][s].get("refused") for r in ranks]  # rank 0 first: the first stage's
    if any(said):  # the other ranks name the first rank's refusal in their own words
        whole = all(said)
        reason = said[0] if whole else f"refused on some ranks only: {said}"
        return {"status": "refused" if whole else "crashed", "reason": first_line(reason, 300)}
    if s >= len(eager.steps) or s >= len(reference.steps):
        return {"status": "skipped", "reason": "eager failed at an earlier step"}
    want, ref = eager.steps[s], reference.steps[s]
    if isinstance(want, str) or isinstance(ref, str):
        return {"status": "skipped", "reason": want if isinstance(want, str) else ref}
    for which, loss in ((eager.dtype, want.loss), (torch.float64, ref.loss)):
        if not math.isfinite(loss):
            said = f"eager's loss in {str(which).removeprefix('torch.')} is {loss}"
            return {"status": "skipped", "reason": f"{said} (its outputs are not finite here)"}
    if eager.dtype == torch.float64:
        return judge_exact(ranks, s, config.dp, want)
    return judge_narrow(ranks, s, config.dp, want, ref, eager.dtype)


def judged(ranks: list[Row], config: Config, eager: Trajectory, reference: Trajectory) -> Row:
    """Every step the ranks ran, judged; the row is its worst step's (each step's kept under
    ``steps`` where there are several), its errors the largest of any step's."""
    count = min(len(r["steps"]) for r in ranks)
    steps = [_judge_step(ranks, s, config, eager, reference) for s in range(count)]
    shares = [r["share"] for r in ranks if r.get("share") is not None]
    row: Row = {"share": min(shares)} if shares else {}
    for key in ("max_err", "eager_err", "ratio"):
        kinds: dict[str, float] = {}
        for step in steps:
            for kind, value in step.get(key, {}).items():
                kinds[kind] = max(kinds.get(kind, 0.0), value)
        if kinds:
            row[key] = kinds
    status = min((s["status"] for s in steps), key=_WORST.index)
    worst = next(i for i, s in enumerate(steps) if s["status"] == status)
    reason = steps[worst].get("reason", "")
    if len(steps) > 1:
        kept = ("status", "reason", "max_err", "ratio")
        row["steps"] = [{k: v for k, v in s.items() if k in kept} for s in steps]
        reason = f"step {worst + 1}: {reason}" if reason else ""
    return {**row, "status": status, "reason": reason}
