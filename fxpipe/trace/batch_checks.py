"""What splitting batches into micro-batches changes for a model: layers that normalise with
the statistics of the batch they see (warned about once per pipeline) and batch sizes
written into the model (refused when the pipeline is built)."""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.errors import BatchStatisticsWarning, PlanError
from fxpipe.model_state import preserved
from fxpipe.passes.ops import module_path
from fxpipe.trace.tracing import Traced

__all__ = ["BatchStatistics", "check_micro_batches"]

#: Position of the ``training`` argument of ``F.batch_norm`` and of aten's batch-norm ops.
_TRAINING_ARG = 5
#: Frames in these folders are fxpipe's or torch's; a warning points at the first other one.
_INNER_DIRS = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))


@dataclass
class BatchStatistics:
    """The layers of a traced graph that normalise with the statistics of their batch."""

    #: Module path of each such layer, with the module where its mode can change (fx) or
    #: ``None`` where the graph fixes it in training mode (torch.export, ``F.batch_norm``).
    layers: tuple[tuple[str, _BatchNorm | None], ...]
    #: "fx" or "export": whether ``deferred_batch_norm`` is available to the remedy.
    tracer: str
    warned: bool = False
    #: The option that sets the number of micro-batches: ``"chunks"`` (``fxpipe.pipeline``,
    #: which offers ``deferred_batch_norm``) or ``"n_microbatches"`` (the multi-process mode,
    #: which does not).
    option: str = "chunks"
    #: Ops that mix the batch's rows (a router's capacity over the batch): (the node as a
    #: message names it, why), from :attr:`fxpipe.trace.tracing.Traced.row_mixing`.
    mixing: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, traced: Traced, option: str = "chunks") -> BatchStatistics:
        gm = traced.graph_module
        layers: dict[str, _BatchNorm | None] = {}
        for node in gm.graph.nodes:
            if node.op == "call_module":
                module = gm.get_submodule(str(node.target))
                if isinstance(module, _BatchNorm):
                    layers[str(node.target)] = module
            elif node.op == "call_function" and _fixed_training_batch_norm(node):
                layers.setdefault(module_path(node) or node.name, None)
        return cls(tuple(layers.items()), traced.tracer, option=option, mixing=traced.row_mixing)

    def active(self) -> list[str]:
        """The layers that use batch statistics now (their modules' current mode)."""
        return [
            name for name, m in self.layers if m is None or m.training or not m.track_running_stats
        ]

    def warn_once(self, micro_batches: int) -> None:
        """A BatchStatisticsWarning at the first call that splits a batch while such layers
        are active; never again for this pipeline."""
        if self.warned or micro_batches < 2:
            return
        names = self.active()
        if not names and not self.mixing:
            return
        self.warned = True
        said = [_mixing_message(self.mixing, self.option)] if self.mixing else []
        if names:
            said.insert(0, _statistics_message(names, self.tracer, self.option))
        warnings.warn(" ".join(said), BatchStatisticsWarning, stacklevel=_caller_level())


def _fixed_training_batch_norm(node: fx.Node) -> bool:
    if "batch_norm" not in getattr(node.target, "__name__", str(node.target)):
        return False
    if "training" in node.kwargs:
        return node.kwargs["training"] is True
    return len(node.args) > _TRAINING_ARG and node.args[_TRAINING_ARG] is True


#: What the multi-process mode adds to the batch-statistics warning.
_REPLICAS = (
    " With data parallelism over a mesh, each replica also updates its own copy of the "
    "running statistics from its own micro-batches (nothing synchronises buffers), so the "
    "copies differ between replicas."
)


def _mixing_message(mixing: tuple[tuple[str, str], ...], option: str) -> str:
    shown = "; ".join(f"{where} {why}" for where, why in mixing[:3])
    more = f" (and {len(mixing) - 3} more)" if len(mixing) > 3 else ""
    return (
        f"{len(mixing)} op{'s' if len(mixing) > 1 else ''} of this model mix the batch's rows "
        f"({shown}{more}), as a router that drops tokens over an expert's capacity counted "
        "over the whole batch does: each micro-batch computes them over its own rows, as "
        "GPipe runs such a router, so this pipeline's outputs and gradients differ from the "
        f"unpipelined model's on the whole batch. For outputs equal to the model's, pass "
        f"{option}=1. This warning is given once per pipeline."
    )


def _statistics_message(names: list[str], tracer: str, option: str) -> str:
    shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
    layers = f"{len(names)} BatchNorm layer{'s' if len(names) > 1 else ''} ({shown})"
    deferred = (
        " deferred_batch_norm=True makes the running statistics equal to the model's (one "
        "update per batch, from the whole batch's mean and variance); outputs in training "
        "still use each micro-batch's statistics."
        if tracer == "fx"
        else " deferred_batch_norm=True, which makes the running statistics equal to the "
        "model's, needs a graph from torch.fx (tracer='fx'); this one came from torch.export."
    )
    remedy = deferred if option == "chunks" else _REPLICAS
    return (
        f"{layers} in training mode {'normalise' if len(names) > 1 else 'normalises'} each "
        "micro-batch with its own mean and "
        "variance (as GPipe does), so in training this pipeline's outputs and gradients "
        "differ from the unpipelined model's, and the running statistics are updated once "
        f"per micro-batch instead of once per batch.{remedy} "
        f"For outputs equal to the model's, pass {option}=1 "
        "or use a norm without batch statistics (GroupNorm, LayerNorm); in eval mode "
        "outputs are equal. This warning is given once per pipeline."
    )


def _caller_level() -> int:
    """``warnings.warn``'s stacklevel for the first frame outside fxpipe and torch."""
    level, frame = 2, sys._getframe(2)  # the frame that called warn_once
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INNER_DIRS):
        frame, level = frame.f_back, level + 1
    return level


# ------------------------------------------------------------------ batch sizes in the model


def check_micro_batches(
    traced: Traced, chunks: int, model: nn.Module, option: str = "chunks"
) -> None:
    """PlanError when the graph runs on fake tensors of the example batch but not on those of
    the micro-batches ``chunks`` splits it into: a batch size written into the model. The
    message names ``option``, the argument that set ``chunks``."""
    gm, values = traced.graph_module, traced.example_values
    batch = _example_rows(values)
    if batch is None or chunks < 2:
        return
    parts = min(chunks, batch)
    with preserved(model):
        for size in sorted({-(-batch // parts), batch // parts} - {batch}, reverse=True):
            failure = _failure(gm, values, size)
            if failure is not None and _failure(gm, values, batch) is None:
                raise PlanError(_sizes_message(*failure, size, batch, option, chunks))


def _example_rows(values: tuple[Any, ...]) -> int | None:
    tensors = [t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor) and t.ndim]
    return int(tensors[0].shape[0]) if tensors else None


def _failure(
    gm: fx.GraphModule, values: tuple[Any, ...], rows: int
) -> tuple[fx.Node, Exception] | None:
    """The node that fails, and how, when ``gm`` runs on fake tensors of ``rows`` rows."""
    runner = _NodeTracking(gm)

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.ndim == 0:
            return t
        return torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)

    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            runner.run(*tree_map(fake, values))
    except Exception as e:
        return (runner.node, e) if runner.node is not None else None
    return None


class _NodeTracking(fx.Interpreter):
    """An interpreter that remembers the node it is running."""

    node: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.node = n
        return super().run_node(n)


def _sizes_message(
    node: fx.Node, error: Exception, size: int, batch: int, option: str, chunks: int
) -> str:
    path = module_path(node)
    where = f"at {_call_text(node)} " + (f"in module {path!r}" if path else "in forward")
    source = _source_line(node)
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return (
        f"the model runs on the example batch of {batch} rows but not on its micro-batches "
        f"of {size} rows ({option}={chunks}): {where}{source}: {first}. A batch size written "
        "into the model fits only batches of that size: compute it from the input "
        f"(x.shape[0], or -1 in reshape/view), or pass {option}=1 to run whole batches"
    )


def _call_text(node: fx.Node) -> str:
    """``reshape(h, 3, -1)``: the node as a call, its inputs by name."""
    name = node.target if isinstance(node.target, str) else node.target.__name__
    args = [a.name if isinstance(a, fx.Node) else repr(a) for a in node.args]
    args += [
        f"{k}={v.name if isinstance(v, fx.Node) else repr(v)}" for k, v in node.kwargs.items()
    ]
    text = f"{name}({', '.join(args)})"
    return text if len(text) <= 80 else text[:77] + "..."


def _source_line(node: fx.Node) -> str:
    """`` (file.py:17: h = h.reshape(3, -1))`` when the tracer recorded where the node came
    from, else ``""``."""
    lines = [line.strip() for line in str(node.meta.get("stack_trace") or "").splitlines()]
    files = [k for k, line in enumerate(lines) if line.startswith("File ")]
    if not files or files[-1] + 1 >= len(lines):
        return ""
    where = lines[files[-1]].split('"')
    file = os.path.basename(where[1]) if len(where) > 2 else "?"
    number = where[2].split(",")[1].strip().removeprefix("line ") if len(where) > 2 else "?"
    return f" ({file}:{number}: {lines[files[-1] + 1]})"
