"""Render the README's pictures: the stage graph, the balance chart and a recorded timeline of
the U-Net in ``factories.py`` over four CPU stages, and print the plan they show.

    python examples/render_docs.py            # writes docs/*.png
    python examples/render_docs.py --out /tmp/pictures

The plan uses the analytic FLOP cost model, so the stage graph and the balance chart are the
same on every machine. The timeline is measured: of a few recorded training steps (after a
warm-up step) it keeps the fastest, the one least disturbed by other work on the machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import fxpipe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from factories import unet  # noqa: E402  (examples/ is a folder of scripts, not a package)

DOCS = Path(__file__).resolve().parents[1] / "docs"


def record_step(pipe: fxpipe.Pipeline, x: torch.Tensor, tries: int) -> fxpipe.Timeline:
    """The fastest of ``tries`` recorded training steps, after one unrecorded warm-up step."""
    pipe(x).sum().backward()
    best: fxpipe.Timeline | None = None
    for _ in range(tries):
        pipe.zero_grad(set_to_none=True)
        with fxpipe.record(pipe) as timeline:
            pipe(x).sum().backward()
        if best is None or timeline.makespan < best.makespan:
            best = timeline
    assert best is not None
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DOCS, help="folder for the pictures")
    parser.add_argument("--tries", type=int, default=5, help="recorded steps to choose from")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    # One intra-op thread: the timeline then shows the schedule, not contention between
    # thread pools (the four stages share the CPU).
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(16, 3, 64, 64)
    pipe = fxpipe.pipeline(unet(), x, ["cpu"] * 4, chunks=8, cost="flops")
    print(pipe.plan, end="\n\n")
    pipe.plan.draw(args.out / "stage_graph.png")
    pipe.plan.draw_balance(args.out / "balance.png")
    timeline = record_step(pipe, x, args.tries)
    print(timeline.summary())
    timeline.plot(
        args.out / "timeline.png",
        title="U-Net, 4 stages on one CPU, chunks=8: one recorded training step",
    )
    for name in ("stage_graph.png", "balance.png", "timeline.png"):
        path = args.out / name
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
