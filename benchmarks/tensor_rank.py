"""One tensor-parallel rank's share of a stage's work, measured against the share the layout
model gives it: the time of one training step (forward and backward) of the program one of
``tp`` ranks runs, over the time of the whole graph, on one device.

Run from the repository root::

    python -m benchmarks.tensor_rank [--device cpu|cuda] [--model tiny|mid|llama-7b]
                                     [--tp 2,4,8] [--repeats N] [--compile] [--out PATH]

The model is a Llama decoder from a transformers config (``llama-7b``: two of Llama-7B's
blocks, its width, heads and vocabulary, 2048 tokens, in bfloat16; ``mid``: a quarter of its
width, 512 tokens, in float32, for a CPU; ``tiny``: a small one), traced as fxpipe traces
it. Per ``tp``, the graph's tensor-parallel plan (what
``fd.pipeline_schedule(tensor_parallel="auto")`` finds) cuts it, and ``parallelize_stage``
makes rank 0's program: its cut products hold ``1 / tp`` of their weights. One device
cannot hold the ``tp`` ranks of a group, so the program runs in a process of torch's fake
process group, whose collectives return at once: the time is the rank's compute alone, the
part ``fxpipe.distributed.planning.tensor_costs`` divides by ``tp``; the collectives it adds are
priced from the link's bandwidth, which one device cannot measure. The predicted share is
the cut cost table's total over the whole one's, with an infinite link (FLOP and roofline
pricing). With ``--compile`` both run through ``torch.compile`` (which removes DTensor's
dispatch from the rank's step, as ``compile=True`` with tensor parallelism does). Steps
alternate round by round (``benchmarks.harness.timing``); the rows go to
``benchmarks/results/tensor_rank.json`` (``tensor_rank_cuda.json`` on a GPU).
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from benchmarks.harness.machine import device_record
from benchmarks.harness.output import command_line, format_table, result_path, save_json
from benchmarks.harness.timing import time_interleaved
from fxpipe.distributed.planning.tensor_costs import tensor_costs
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.passes.price.roofline import step_roofline_for
from fxpipe.passes.tensor.parallelize import parallelize_stage
from fxpipe.passes.tensor.plan import tensor_plan
from fxpipe.trace.tracing import trace

#: Model name -> (config keywords, batch, sequence length, dtype).
SHAPES: dict[str, tuple[dict[str, int], int, int, torch.dtype]] = {
    "llama-7b": (
        dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
             num_key_value_heads=32, num_hidden_layers=2, vocab_size=32000),
        1, 2048, torch.bfloat16,
    ),
    "mid": (
        dict(hidden_size=1024, intermediate_size=2752, num_attention_heads=16,
             num_key_value_heads=16, num_hidden_layers=2, vocab_size=8000),
        1, 512, torch.float32,
    ),
    "tiny": (
        dict(hidden_size=256, intermediate_size=688, num_attention_heads=8,
             num_key_value_heads=8, num_hidden_layers=2, vocab_size=4000),
        2, 128, torch.float32,
    ),
}  # fmt: skip


def _model(name: str, device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    import transformers

    keywords, batch, length, dtype = SHAPES[name]
    config = transformers.LlamaConfig(max_position_embeddings=length, use_cache=False,
                                      **keywords)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device, dtype).train()
    return model, torch.randint(0, keywords["vocab_size"], (batch, length), device=device)


def _step(program: nn.Module, example: tuple[Any, ...], device: torch.device) -> Callable[[], Any]:
    def step() -> None:
        program.zero_grad(set_to_none=True)
        out = program(*example)
        logits = next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        logits = logits.to_local() if hasattr(logits, "to_local") else logits
        logits.float().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def _predicted(
    gm: Any, example: tuple[Any, ...], tp: int, device: torch.device
) -> dict[str, float]:
    """The cut cost table's total over the whole one's, per pricing, links infinitely fast."""
    out = {}
    for mode in ("flops", "roofline"):
        roofline = step_roofline_for(device.type) if mode == "roofline" else None
        costs = estimate_costs(gm, example, mode=mode, device=device, micro_batches=1,
                               roofline=roofline)  # fmt: skip
        cut, _ = tensor_costs(gm, example, costs, tp, bandwidth=float("inf"), seconds=1.0)
        out[mode] = sum(c.cost for c in cut.nodes.values()) / sum(
            c.cost for c in costs.nodes.values()
        )
    return out


def measure(
    name: str, tps: list[int], repeats: int, device: torch.device, compiled: bool = False
) -> list[dict[str, Any]]:
    """Per ``tp``: rank 0's program and the whole graph, timed side by side (both through
    ``torch.compile`` with ``compiled``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model, ids = _model(name, device)
    traced = trace(model, (ids,))
    gm, example = traced.graph_module, tuple(traced.example_values)
    rows = []
    for tp in tps:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
        try:
            mine = copy.deepcopy(gm)
            plan = tensor_plan(mine, tp, example)
            program = parallelize_stage(mine, plan, init_device_mesh(device.type, (tp,)))
            runs: tuple[nn.Module, nn.Module] = (gm, program)
            if compiled:
                runs = (torch.compile(gm), torch.compile(program))
            steps = {
                "whole": _step(runs[0], example, device),
                "rank": _step(runs[1], example, device),
            }
            wall = time_interleaved(nn.Module(), steps, repeats, budget_s=120.0)["wall"]
        finally:
            dist.destroy_process_group()
        del program, mine
        per_round = sorted(a / b for a, b in zip(wall["rank"], wall["whole"], strict=True))
        rows.append({
            "model": name, "tp": tp, "compiled": compiled,
            "whole_ms": 1e3 * statistics.median(wall["whole"]),
            "rank_ms": 1e3 * statistics.median(wall["rank"]),
            "measured_share": statistics.median(per_round),
            "predicted_share": _predicted(gm, example, tp, device),
            "plan": plan.summary().splitlines()[0],
        })  # fmt: skip
        print(f"tp={tp}: done", flush=True)
    return rows


def rank_arguments(description: str, repeats: int) -> argparse.ArgumentParser:
    """The options of a benchmark of one tp rank's program: --out, --device, --model, --tp
    (a list), --repeats."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="mid", choices=sorted(SHAPES))
    parser.add_argument("--tp", default="2,4,8")
    parser.add_argument("--repeats", type=int, default=repeats)
    return parser


def rank_device(name: str) -> torch.device:
    """The device a rank benchmark runs on (one torch thread on a CPU)."""
    device = torch.device(name)
    if device.type == "cpu":
        torch.set_num_threads(1)
    return device


def save_rows(
    base: str, device: torch.device, out: str | None, rows: list[Any], suffix: str = ""
) -> int:
    """Write ``rows`` with the command and the machine to ``out``, or to
    ``benchmarks/results/`` as ``BASE.json`` (``BASE_cuda.json`` on a GPU), ``suffix``
    ending the name."""
    device_part = "" if device.type == "cpu" else f"_{device.type}"
    meta = {"command": command_line(), **device_record(device)}
    path = Path(out) if out else result_path(base + device_part + suffix)
    return save_json(path, {"meta": meta, "rows": rows})


def main(argv: list[str] | None = None) -> int:
    parser = rank_arguments(__doc__.splitlines()[0], repeats=10)
    parser.add_argument("--compile", action="store_true", help="both through torch.compile")
    a = parser.parse_args(argv)
    device = rank_device(a.device)
    rows = measure(a.model, [int(t) for t in a.tp.split(",")], a.repeats, device, a.compile)
    columns = [
        ("model", lambda r: r["model"]),
        ("tp", lambda r: str(r["tp"])),
        ("whole ms", lambda r: f"{r['whole_ms']:.2f}"),
        ("rank ms", lambda r: f"{r['rank_ms']:.2f}"),
        ("measured share", lambda r: f"{r['measured_share']:.3f}"),
        ("predicted (flops)", lambda r: f"{r['predicted_share']['flops']:.3f}"),
        ("predicted (roofline)", lambda r: f"{r['predicted_share']['roofline']:.3f}"),
        ("1/tp", lambda r: f"{1 / r['tp']:.3f}"),
    ]
    print(format_table(rows, columns, left=1))
    for r in rows:
        print(f"tp={r['tp']}: {r['plan']}")
    return save_rows("tensor_rank", device, a.out, rows, "_compiled" if a.compile else "")


if __name__ == "__main__":
    raise SystemExit(main())
