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

Modules:

- ``options``: :class:`ScheduleOptions` and the checks of every option (``suggest_layout``
  shares them); the schedules' names and where each places the stages.
- ``build``: :func:`pipeline_schedule`: the record made from its keywords, planning,
  activation shapes.
- ``agreement``: what building communicates: the costs group rank 0 measures for
  ``cost="time"``, broadcast, and the one all-gather that checks every rank planned alike.
- ``shapes``: each stage's input and output shapes for one micro-batch, from a run of the
  stage program on fake tensors.
- ``step_shapes``: each step's input sizes, sent by the first rank to the others (one small
  broadcast per step), so that a step may have another sequence length than the last.
- ``runner``: :class:`DistributedPipeline`: this rank's stages, the torch schedule, its
  parameters and state-dict shard.
- ``stage``: a stage as torch's schedules run it: the stage module (the model's arguments
  in, what torch sends out) and the ``PipelineStage`` whose checks run at each step's start
  and whose buffers are re-made for a step of other sizes.
- ``gradients``: the gradients of parameters held on several ranks (or left whole by FSDP)
  summed once per step (``sync_tied_gradients``).
- ``tied_guard``: an update of such a parameter without that sum, refused at the next step.
- ``checkpoint``: one ``torch.distributed.checkpoint`` for the whole job, at any layout,
  checked by each rank before anything is read.
- ``split_backward``: the weight part of a zero-bubble stage's backward, computed by
  fxpipe from torch's input part (torch's own counts some gradients twice or crashes).
- ``strides``: boundary values and their gradients in eager's memory layout on both sides
  of a send (torch sends contiguous buffers, and some CPU kernels answer wrongly for the
  layouts that otherwise reach them).
- ``ownership``: which of the model's tensors a rank keeps; releasing and materialising
  them; :func:`merge_state_dicts`.
- ``mesh``: pipeline x data parallel: the ``"pp"`` and ``"dp"`` groups of a 2-D
  ``DeviceMesh``, and each stage wrapped in DDP over ``"dp"``.
- ``layout``: :func:`suggest_layout`: the (pp, dp, virtual stages, micro-batches, schedule)
  layouts of a model over ``world_size`` ranks, ranked by predicted step time and memory
  per rank.
- ``layout_estimate``: what the cost model predicts for one layout (a
  :class:`LayoutEstimate` row), and the formulas.
- ``layout_table``: ``format_layouts``, the rows as a table a person reads.
"""

from fxpipe.distributed.build import pipeline_schedule
from fxpipe.distributed.layout import LayoutEstimate, suggest_layout
from fxpipe.distributed.options import SCHEDULES, ScheduleOptions
from fxpipe.distributed.ownership import merge_state_dicts
from fxpipe.distributed.runner import DistributedPipeline

__all__ = [
    "pipeline_schedule",
    "ScheduleOptions",
    "DistributedPipeline",
    "merge_state_dicts",
    "SCHEDULES",
    "suggest_layout",
    "LayoutEstimate",
]
