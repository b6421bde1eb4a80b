"""The ``fxpipe`` console script: ``fxpipe inspect FACTORY`` plans a model, prints the plan and
writes its pictures, an HTML report and (with ``--run``) the timeline of one training step."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO, get_args

import torch
from torch.utils._pytree import tree_flatten

import fxpipe
from fxpipe.command.factory import build_model, eval_input, parse_devices, parse_shape
from fxpipe.errors import ConfigError, FxPipeError
from fxpipe.ir import CheckpointMode, CostMode, TracerName

__all__ = ["main"]

#: Output options, what they write, and the suffixes each accepts.
_OUTPUTS = {
    "dot": ("dot",),
    "draw": ("svg", "png", "pdf", "dot"),
    "balance": ("png", "svg", "pdf"),
    "timeline": ("png", "svg", "pdf"),
    "html": ("html", "htm"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a bad input)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.handler(args))
    except FxPipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxpipe", description="Plan, inspect and draw a model's pipeline stages."
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"fxpipe {fxpipe.__version__} (torch {torch.__version__})",
        help="print the versions of fxpipe and torch and exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "inspect",
        help="plan a model and print its stages",
        description="Plan a model over devices, print the per-stage summary and write views.",
        epilog="example: fxpipe inspect torchvision.models:resnet50 --shape 8,3,224,224 "
        "--devices cpu,cpu,cpu,cpu --html report.html",
    )
    _model_options(p)
    _output_options(p)
    p.set_defaults(handler=_inspect)
    return parser


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "factory",
        help="package.module:function or path/to/file.py:function, "
        "called with no arguments, returning the nn.Module",
    )
    given = p.add_mutually_exclusive_group()
    given.add_argument("--shape", help="example input shape, batch first: 8,3,224,224 (randn)")
    given.add_argument(
        "--input",
        help="example input expression over torch, e.g. "
        '"torch.randint(0, 64, (8, 16))"; a tuple gives several arguments',
    )
    p.add_argument("--kwargs", help="keyword inputs, e.g. \"{'mask': torch.ones(8, 16)}\"")
    p.add_argument(
        "--devices", help="comma-separated, one stage each (default: every GPU, else cpu,cpu)"
    )
    p.add_argument(
        "--cost",
        default="auto",
        choices=get_args(CostMode),
        help="how nodes are priced: roofline (seconds estimated from FLOPs and bytes, runs "
        "nothing), time (profiled forward and backward), flops (analytic FLOPs), params "
        "(parameter bytes), auto (picked for the devices; the default)",
    )
    p.add_argument(
        "--chunks",
        type=_chunks,
        help="micro-batches per batch (default: 4 x stages, at most the batch size), or auto "
        "(the count with the least predicted step that fits; the table is printed)",
    )
    p.add_argument(
        "--checkpoint",
        default="except_last",
        choices=[*get_args(CheckpointMode), "auto"],
        help="which micro-batches recompute their forward in backward instead of keeping "
        "activations: always, except_last (the default), never, or auto (per stage, the "
        "least recomputation that fits)",
    )
    p.add_argument(
        "--tracer",
        default="auto",
        choices=get_args(TracerName),
        help="how the model is captured: fx (torch.fx), export (torch.export) or auto "
        "(fx, then export; the default)",
    )


def _output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dot", metavar="FILE", help="write the Graphviz DOT text")
    p.add_argument(
        "--level",
        default="stage",
        choices=["stage", "node"],
        help="what --dot and --draw show: stages (default) or every node",
    )
    p.add_argument("--draw", metavar="FILE", help="render the graph (.svg/.png/.pdf; Graphviz)")
    p.add_argument("--balance", metavar="FILE", help="write the balance chart (.png/.svg)")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    p.add_argument(
        "--run",
        action="store_true",
        help="run one training step (sum of the outputs as loss) and record it",
    )
    p.add_argument("--timeline", metavar="FILE", help="write the Gantt chart (implies --run)")


def _inspect(args: argparse.Namespace) -> int:
    outputs = _checked_outputs(args)
    run = args.run or "timeline" in outputs
    model = build_model(args.factory)
    example, kwargs = _example(args)
    devices = parse_devices(args.devices)
    options: dict[str, Any] = dict(
        cost=args.cost, tracer=args.tracer, example_kwargs=kwargs, chunks=args.chunks,
        checkpoint=args.checkpoint,
    )  # fmt: skip
    with _progress(f"fxpipe: planning {args.factory} over {len(devices)} stages", sys.stderr):
        if run:
            pipe = fxpipe.pipeline(model, example, devices, **options)
            plan = pipe.plan
        else:
            plan = fxpipe.plan(model, example, devices, **options)
    print(plan.summary())
    if plan.weighed is not None:
        print()
        print(plan.configurations())
    timeline = _train_step(pipe, example, kwargs or {}) if run else None
    if timeline is not None:
        print()
        print(timeline.summary())
    _write(outputs, args, plan, timeline)
    return 0


def _checked_outputs(args: argparse.Namespace) -> dict[str, Path]:
    """Every output path asked for, checked before any work (suffix, folder)."""
    from fxpipe.views.viz import output_path

    checked = {}
    for name, formats in _OUTPUTS.items():
        value = getattr(args, name)
        if value is not None:
            checked[name] = output_path(value, formats)[0]
    if isinstance(args.chunks, int) and args.chunks < 1:
        raise ConfigError(f"--chunks {args.chunks} must be at least 1")
    return checked


def _chunks(text: str) -> int | str:
    """``--chunks``: a whole number, or ``auto``."""
    return text if text == "auto" else int(text)


def _example(args: argparse.Namespace) -> tuple[Any, dict[str, Any] | None]:
    if args.shape is not None:
        example: Any = torch.randn(*parse_shape(args.shape))
    elif args.input is not None:
        example = eval_input(args.input)
    else:
        raise ConfigError("give the example input: --shape 8,3,224,224 or --input EXPRESSION")
    leaves = tree_flatten(example)[0]
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        raise ConfigError(f"the example input is a {type(example).__name__} with no tensor")
    kwargs = eval_input(args.kwargs, "--kwargs") if args.kwargs else None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(f"--kwargs must be a dict expression, not {type(kwargs).__name__}")
    return example, kwargs


def _train_step(pipe: fxpipe.Pipeline, example: Any, kwargs: dict[str, Any]) -> fxpipe.Timeline:
    """One warm-up step, then one recorded step; gradients are cleared after each."""
    call_args = example if isinstance(example, tuple) else (example,)

    def step() -> None:
        leaves = tree_flatten(pipe(*call_args, **kwargs))[0]
        floats = [
            x.float().sum()
            for x in leaves
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad
        ]
        if floats:
            torch.autograd.backward(torch.stack([f.to(floats[0].device) for f in floats]).sum())

    pipe.train()
    step()
    pipe.zero_grad(set_to_none=True)
    with fxpipe.record(pipe) as timeline:
        step()
    pipe.zero_grad(set_to_none=True)
    return timeline


def _write(outputs: dict[str, Path], args: argparse.Namespace, plan: Any, timeline: Any) -> None:
    from fxpipe.views.html_report import write_report

    writers: dict[str, Callable[[Path], Any]] = {
        "dot": lambda p: p.write_text(plan.to_dot(level=args.level)),
        "draw": lambda p: plan.draw(p, level=args.level),
        "balance": lambda p: plan.draw(p, kind="balance"),
        "timeline": lambda p: timeline.plot(p),
        "html": lambda p: write_report(plan, p, timeline=timeline, title=args.factory),
    }
    for name, path in outputs.items():
        writers[name](path)
        print(f"wrote {path}")


# ------------------------------------------------------------------------------ progress


@contextmanager
def _progress(label: str, stream: TextIO) -> Iterator[None]:
    """On a terminal, keep one status line on ``stream`` while the block runs: the planning
    phase, a bar of the nodes priced, the seconds so far (from the records of the ``fxpipe``
    logger, :mod:`fxpipe.progress`); elsewhere print nothing."""
    if not stream.isatty():
        yield
        return
    status = _Status()
    logger = logging.getLogger("fxpipe")
    level = logger.level
    done = threading.Event()
    start = time.perf_counter()

    def tick() -> None:
        while not done.wait(0.25):
            stream.write(f"\r{label}: {status.describe()}, {time.perf_counter() - start:.0f} s ")
            stream.flush()

    thread = threading.Thread(target=tick, daemon=True)
    logger.addHandler(status)
    logger.setLevel(logging.DEBUG)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        logger.removeHandler(status)
        logger.setLevel(level)
        stream.write(f"\r{label}: done in {time.perf_counter() - start:.1f} s\x1b[K\n")
        stream.flush()


class _Status(logging.Handler):
    """The phase fxpipe's logger last reported, and how many nodes pricing has done."""

    #: What the status line says during each phase.
    WORDS = {
        "trace": "tracing",
        "check": "checking the outputs",
        "price": "pricing",
        "partition": "searching the stages",
        "split": "writing the stage modules",
    }
    #: Width of the bar, in characters.
    WIDTH = 20

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.phase = ""
        self.done = 0
        self.total = 0

    def emit(self, record: logging.LogRecord) -> None:
        phase = getattr(record, "fxpipe_phase", None)
        if phase is None:
            return
        self.phase = phase
        if getattr(record, "fxpipe_state", None) == "progress":
            self.done = int(getattr(record, "done", 0))
            self.total = int(getattr(record, "total", 0))

    def describe(self) -> str:
        words = self.WORDS.get(self.phase, "starting")
        if self.phase != "price" or not self.total:
            return words
        filled = self.WIDTH * self.done // self.total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        return f"{words} [{bar}] {self.done}/{self.total} nodes"
