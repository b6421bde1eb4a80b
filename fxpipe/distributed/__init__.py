"""Runs an fxpipe plan on ``torch.distributed.pipelining``, one process per stage (or stages).

Every rank calls :func:`pipeline_schedule` with the same model and example. Each rank traces
and plans the model the same way (from deterministic costs, or with ``cost="time"`` from the
costs group rank 0 measured and broadcast), checks with one collective that all ranks agree,
builds torch ``PipelineStage`` objects for its own stages from the relay-mode stage program
(a skip connection passes through every stage in between, since torch only connects
neighbouring stages), and releases every other stage's parameters and buffers to the
``meta`` device. The schedule is then used the torch way::

    pipe = pipeline_schedule(model, x, schedule="1f1b", n_microbatches=8, loss_fn=loss_fn)
    losses = []
    if pipe.is_first:
        pipe.schedule.step(x, target=y if pipe.is_last else None, losses=losses)
    elif pipe.is_last:
        pipe.schedule.step(target=y, losses=losses)
    else:
        pipe.schedule.step()
    pipe.sync_tied_gradients()      # sums a shared weight's copies (a no-op without one)
    optimizer.step()                # optimizer over pipe.parameters()

Its options are one frozen record, :class:`ScheduleOptions`: ``pipeline_schedule`` makes it
from its keywords, checked on every rank before any communication, and the rest takes it;
``pipeline_schedule(model, x, loss_fn=loss_fn, **options.keywords())`` runs a record made
beforehand, such as the one a layout :func:`suggest_layout` ranks gives
(:attr:`LayoutEstimate.options`).

Rooms (each a package with its own docstring), and the two modules at the top:

- ``options``: :class:`ScheduleOptions` and the checks of every option (``suggest_layout``
  shares them); the schedules' names and where each places the stages.
- ``build``: :func:`pipeline_schedule`: the record made from its keywords, planning,
  activation shapes; the one module that joins the rooms.
- ``planning/``: before any rank runs: :func:`suggest_layout` and what the cost model
  predicts for each layout (``layout``, ``priced``, ``estimate``, ``table``,
  ``tensor_costs``), ``"auto"`` schedules (``auto``), the tensor-parallel plan
  (``tensor_parallel``), the asynchronous schedule's staleness and weight versions per
  stage (``staleness``), and what building communicates (``agreement``: the costs group
  rank 0 measures for ``cost="time"``, and the all-gather that checks every rank planned
  alike).
- ``rank/``: one rank's runtime: :class:`DistributedPipeline` (``runner``), a stage as
  torch's schedules run it (``stage``), the loss on the model's own output structure
  (``losses``), fxpipe's asynchronous schedule ``"Async1F1B"`` (``asynchronous``: no flush,
  each stage updating its own weights) and the weight versions its micro-batches run with
  (``versions``), each stage's and each step's shapes (``shapes``,
  ``step_shapes``), boundary values in eager's memory layout (``strides``), the weight part
  of a zero-bubble backward (``split_backward``), the gradients of Parameters held on
  several ranks and the guard against an update without their sum (``gradients``,
  ``tied_guard``), and one ``torch.distributed.checkpoint`` for the whole job
  (``checkpoint``).
- ``parallel/``: state across ranks: the ``"pp"``, ``"dp"`` and ``"tp"`` groups of a
  ``DeviceMesh`` and each stage wrapped in DDP or FSDP over ``"dp"`` (``mesh``), a
  DTensor's whole and a rank's part (``dtensors``), which of the model's tensors a rank keeps
  and :func:`merge_state_dicts` (``ownership``).

Arrows point one way: ``build`` -> ``rank`` -> ``planning`` -> ``parallel`` -> ``options``.
"""

from fxpipe.distributed.build import pipeline_schedule
from fxpipe.distributed.options import SCHEDULES, ScheduleOptions
from fxpipe.distributed.parallel.ownership import merge_state_dicts
from fxpipe.distributed.planning.layout import LayoutEstimate, suggest_layout
from fxpipe.distributed.rank.runner import DistributedPipeline

__all__ = [
    "pipeline_schedule",
    "ScheduleOptions",
    "DistributedPipeline",
    "merge_state_dicts",
    "SCHEDULES",
    "suggest_layout",
    "LayoutEstimate",
]
