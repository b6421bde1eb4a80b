"""What sequence parallelism buys one tensor-parallel rank: the bytes its step saves for the
backward (the activations), and its time, with the values between row-wise and column-wise
products cut along the sequence and without, side by side; against the layout model's
prediction of the saved bytes.

Run from the repository root::

    python -m benchmarks.sequence_parallel [--device cpu|cuda] [--model tiny|mid|llama-7b]
                                           [--tp 2,4,8] [--repeats N] [--out PATH]

The model is ``benchmarks.tensor_rank``'s Llama decoder. Per ``tp``, rank 0's program is
made twice from the graph's plan (``sequence_parallel=False`` and ``"auto"``) and run in a
process of torch's fake process group, whose collectives return at once: the time is the
rank's compute alone (the collectives are the same bytes either way: a reduce-scatter and
an all-gather make an all-reduce). The saved bytes are those autograd keeps for the
backward during one forward (each storage counted once; a DTensor by its local piece),
read by ``torch.autograd.graph.saved_tensors_hooks``. The predicted ratio is the cut cost
table's saved bytes with sequence parallelism over those without
(``fxpipe.distributed.planning.tensor_costs``). Steps alternate round by round
(``benchmarks.harness.timing``); the rows go to ``benchmarks/results/sequence_parallel.json``
(``sequence_parallel_cuda.json`` on a GPU).
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from benchmarks.harness.output import format_table
from benchmarks.harness.timing import time_interleaved
from benchmarks.tensor_rank import _model, _step, rank_arguments, rank_device, save_rows
from fxpipe.distributed.planning.tensor_costs import tensor_costs
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.passes.tensor.parallelize import parallelize_stage
from fxpipe.passes.tensor.plan import tensor_plan
from fxpipe.trace.tracing import trace

#: The two programs of each tp: values between products whole, and cut along the sequence.
CHOICES: dict[str, Any] = {"off": False, "on": "auto"}


def saved_bytes(program: nn.Module, example: tuple[Any, ...]) -> int:
    """Bytes autograd saves for the backward in one forward of ``program`` (each storage
    once; a DTensor by its local piece)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        for plain in _plain(t):
            storage = plain.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = program(*example)
    del out
    params = {p.untyped_storage().data_ptr() for q in program.parameters() for p in _plain(q)}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data (a DTensor's local piece, a collective's
    result), through tensor subclasses."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]
        return [p for x in inner if isinstance(x, torch.Tensor) for p in _plain(x)]
    return [t]


def _predicted_saved(gm: Any, example: tuple[Any, ...], tp: int, device: torch.device) -> float:
    costs = estimate_costs(gm, example, mode="flops", device=device, micro_batches=1)
    saved = {}
    for key, choice in CHOICES.items():
        cut, _ = tensor_costs(gm, example, costs, tp, bandwidth=float("inf"), seconds=1.0,
                              sequence_parallel=choice)  # fmt: skip
        saved[key] = sum(c.saved_bytes for c in cut.nodes.values())
    return saved["on"] / saved["off"]


def measure(name: str, tps: list[int], repeats: int, device: torch.device) -> list[dict[str, Any]]:
    """Per ``tp``: rank 0's program without and with sequence parallelism, side by side."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model, ids = _model(name, device)
    traced = trace(model, (ids,))
    gm, example = traced.graph_module, tuple(traced.example_values)
    rows = []
    for tp in tps:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
        try:
            mesh = init_device_mesh(device.type, (tp,))
            programs, plans = {}, {}
            for key, choice in CHOICES.items():
                mine = copy.deepcopy(gm)
                plans[key] = tensor_plan(mine, tp, example, sequence_parallel=choice)
                programs[key] = parallelize_stage(mine, plans[key], mesh)
            saved = {key: saved_bytes(p, example) for key, p in programs.items()}
            steps = {key: _step(p, example, device) for key, p in programs.items()}
            wall = time_interleaved(nn.Module(), steps, repeats, budget_s=120.0)["wall"]
        finally:
            dist.destroy_process_group()
        per_round = sorted(a / b for a, b in zip(wall["on"], wall["off"], strict=True))
        rows.append({
            "model": name, "tp": tp,
            "saved_mib_off": saved["off"] / 2**20, "saved_mib_on": saved["on"] / 2**20,
            "saved_ratio": saved["on"] / saved["off"],
            "predicted_saved_ratio": _predicted_saved(gm, example, tp, device),
            "rank_ms_off": 1e3 * statistics.median(wall["off"]),
            "rank_ms_on": 1e3 * statistics.median(wall["on"]),
            "time_ratio": statistics.median(per_round),
            "cut_values": len(plans["on"].sequence),
        })  # fmt: skip
        print(f"tp={tp}: done", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    a = rank_arguments(__doc__.splitlines()[0], repeats=7).parse_args(argv)
    device = rank_device(a.device)
    rows = measure(a.model, [int(t) for t in a.tp.split(",")], a.repeats, device)
    columns = [
        ("model", lambda r: r["model"]),
        ("tp", lambda r: str(r["tp"])),
        ("saved MiB off", lambda r: f"{r['saved_mib_off']:.1f}"),
        ("saved MiB on", lambda r: f"{r['saved_mib_on']:.1f}"),
        ("saved on/off", lambda r: f"{r['saved_ratio']:.3f}"),
        ("predicted on/off", lambda r: f"{r['predicted_saved_ratio']:.3f}"),
        ("rank ms off", lambda r: f"{r['rank_ms_off']:.1f}"),
        ("rank ms on", lambda r: f"{r['rank_ms_on']:.1f}"),
        ("time on/off", lambda r: f"{r['time_ratio']:.3f}"),
    ]
    print(format_table(rows, columns, left=1))
    return save_rows("sequence_parallel", device, a.out, rows)


if __name__ == "__main__":
    raise SystemExit(main())
