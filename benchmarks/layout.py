"""Pipeline x data-parallel layouts of Llama-7B's shape: what ``fd.suggest_layout`` ranks first
at several world sizes, on ``meta`` (no weights, no memory, FLOP costs).

Run from the repository root (transformers is in the ``test`` extra)::

    python -m benchmarks.layout [--out PATH] [--worlds 8 64 128 512] [--batch 512]
                                [--tokens 2048] [--budget 80GiB] [--slack 0.01] [--top 8]
                                [--compare 64] [--data-parallel ddp fsdp]
                                [--model llama-7b|llama-70b] [--tensor-parallel 1 2 4 8]

``--tensor-parallel`` ranks (pp, dp, tp) layouts, each rank's work cut by the model's own
tensor-parallel plan over ``tp`` ranks joined by NVLink (an A100's, 300 GB/s each way);
``--model llama-70b`` takes Llama-2-70B's shape (80 layers, width 8,192, grouped-query
attention with 8 key-value heads).

The global batch defaults to 512 sequences of 2,048 tokens, the batch and sequence length
of the 7.5B GPT in Narayanan et al. 2021's Table 1 (h = 4096 like Llama-7B's; 36 layers
against 32), so that the layouts can be set beside the one that paper ran for it. The model
is float32 as ``benchmarks.hf_plan`` builds it (16 bytes of weights, gradients and Adam state per
parameter, as mixed precision with Adam takes too; activations twice bf16's). Each world
size gets one ``suggest_layout`` call (trace and pricing included) at ``--slack``; those in
``--compare`` one more at slack 0, fxpipe's default, whose best layout is printed too.
Replicas share their gradients both ways ``fd.pipeline_schedule`` offers, DDP and FSDP
(``--data-parallel``), each layout with replicas ranked once per way.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import transformers

import fxpipe.distributed as fd
from benchmarks.harness.models.giants import GIANTS
from benchmarks.harness.output import command_line, result_path, save_json
from fxpipe.distributed.planning.layout import (
    DEFAULT_DEVICE_FLOPS,
    DEFAULT_DP_BANDWIDTH,
    DEFAULT_LINK_BANDWIDTH,
    DEFAULT_TP_BANDWIDTH,
    format_layouts,
)

GIB = 2.0**30
#: Rows kept per world size and slack in the JSON file (the best ones).
KEPT = 30


def run_world(
    model: torch.nn.Module,
    ids: torch.Tensor,
    world: int,
    budget: str,
    slack: float,
    data_parallel: Sequence[str],
    tensor_parallel: Sequence[int] = (1,),
    checkpoint: str = "never",
) -> tuple[list[fd.LayoutEstimate], float]:
    started = time.perf_counter()
    layouts = fd.suggest_layout(
        model, ids, world, max_memory=budget, slack=slack, data_parallel=data_parallel,
        tensor_parallel=[t for t in tensor_parallel if world % t == 0],
        checkpoint=checkpoint,  # type: ignore[arg-type]
    )  # fmt: skip
    return layouts, time.perf_counter() - started


def _name(e: fd.LayoutEstimate) -> str:
    replicas = f" {e.data_parallel}" if e.dp > 1 else ""
    tp = f" tp={e.tp}" if e.tp > 1 else ""
    return f"pp={e.pp} dp={e.dp}{tp} v={e.virtual} m={e.chunks} {e.schedule}{replicas}"


def summary(world: int, layouts: Sequence[fd.LayoutEstimate], seconds: float) -> str:
    fits = [e for e in layouts if e.fits]
    least = min(layouts, key=lambda e: e.memory_bytes)
    lines = [
        f"world {world}: {len(layouts)} layouts, {len(fits)} fit; {seconds:.1f} s "
        "(trace, price, every split)",
        f"  least memory: {_name(least)}, {least.memory_bytes / GIB:.1f} GiB per rank",
    ]
    alone = [e for e in layouts if e.pp == 1 and e.tp == 1]
    for kind in dict.fromkeys(e.data_parallel for e in alone):
        plain = min(
            (e for e in alone if e.data_parallel == kind),
            key=lambda e: e.memory_bytes,
        )
        lines.append(
            f"  data parallel alone (pp=1, {kind}): {plain.memory_bytes / GIB:.1f} GiB per "
            f"rank, {'fits' if plain.fits else 'does not fit'}"
        )
    return "\n".join(lines)


def best_line(slack: float, layouts: Sequence[fd.LayoutEstimate]) -> str:
    best = layouts[0]
    return (
        f"  best at slack {slack:g}: {_name(best)}: step {best.step_s:.2f} s (p2p "
        f"{best.p2p_s:.2f} s), "
        f"{best.memory_bytes / GIB:.1f} GiB, {'fits' if best.fits else 'does not fit'}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=result_path("layout"),
        help="where to write the JSON rows (default: benchmarks/results/layout.json)",
    )
    parser.add_argument("--worlds", type=int, nargs="*", default=[8, 64, 128, 512])
    parser.add_argument("--batch", type=int, default=512, help="sequences per step, in all")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--budget", default="80GiB", help="memory per rank")
    parser.add_argument("--slack", type=float, default=0.01)
    parser.add_argument("--top", type=int, default=8, help="rows printed per world size")
    parser.add_argument(
        "--compare", type=int, nargs="*", default=[64], help="world sizes also run at slack 0"
    )
    parser.add_argument(
        "--data-parallel", nargs="*", default=["ddp", "fsdp"], help="how replicas share"
    )
    parser.add_argument("--model", default="llama-7b", choices=["llama-7b", "llama-70b"])
    parser.add_argument(
        "--checkpoint", default="never", choices=["never", "except_last", "always"],
        help="activation checkpointing the memory estimate assumes",
    )  # fmt: skip
    parser.add_argument(
        "--tensor-parallel", type=int, nargs="*", default=[1], help="tp sizes to rank"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    command = command_line()
    print(
        f"command: {command}\ntorch {torch.__version__}, transformers "
        f"{transformers.__version__}, python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    build, vocab = GIANTS[args.model]
    with torch.device("meta"):
        model = build()
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, vocab, (args.batch, args.tokens), device="meta")
    tps = " x ".join(map(str, args.tensor_parallel))
    print(
        f"\n{args.model} shape ({params / 1e9:.2f}B parameters, float32) on meta; tp "
        f"{tps} (NVLink {DEFAULT_TP_BANDWIDTH / 1e9:.0f} GB/s); global batch "
        f"{args.batch} x {args.tokens} tokens; {args.budget} per rank; cost='flops' at "
        f"{DEFAULT_DEVICE_FLOPS / 1e12:.0f} TFLOP/s per rank; p2p "
        f"{DEFAULT_LINK_BANDWIDTH / 1e9:.0f} GB/s, all-reduce "
        f"{DEFAULT_DP_BANDWIDTH / 1e9:.0f} GB/s per rank; schedules 1F1B and "
        f"interleaved 1F1B (v = 2, 4); replicas by {' and '.join(args.data_parallel)}; "
        f"activation checkpointing {args.checkpoint!r}; slack {args.slack:g}.\n",
        flush=True,
    )
    worlds: list[dict[str, Any]] = []
    for world in args.worlds:
        layouts, seconds = run_world(
            model, ids, world, args.budget, args.slack, args.data_parallel,
            args.tensor_parallel, args.checkpoint,
        )  # fmt: skip
        row: dict[str, Any] = {
            "world": world,
            "slack": args.slack,
            "seconds": seconds,
            "count": len(layouts),
            "fitting": sum(e.fits for e in layouts),
            "rows": [asdict(e) for e in layouts[:KEPT]],
        }
        print(summary(world, layouts, seconds))
        if world in args.compare:
            default, row["default_slack_seconds"] = run_world(
                model, ids, world, args.budget, 0.0, args.data_parallel,
                args.tensor_parallel, args.checkpoint,
            )  # fmt: skip
            row["default_slack_rows"] = [asdict(e) for e in default[:KEPT]]
            print(best_line(0.0, default))
        print(format_layouts(layouts, args.top), end="\n\n", flush=True)
        worlds.append(row)
    wall = time.perf_counter() - started
    print(f"wall time {wall:.0f} s")
    payload = {
        "command": command,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": args.model,
        "tensor_parallel": args.tensor_parallel,
        "checkpoint": args.checkpoint,
        "tp_bandwidth": DEFAULT_TP_BANDWIDTH,
        "parameters": params,
        "batch": args.batch,
        "tokens": args.tokens,
        "budget": args.budget,
        "device_flops": DEFAULT_DEVICE_FLOPS,
        "link_bandwidth": DEFAULT_LINK_BANDWIDTH,
        "dp_bandwidth": DEFAULT_DP_BANDWIDTH,
        "worlds": worlds,
        "wall_s": wall,
    }
    return save_json(args.out, payload)


if __name__ == "__main__":
    raise SystemExit(main())
