"""The one place a run's options are resolved against its plan: how many micro-batches, which
checkpoint mode per stage, and what training would need of a plan made for inference."""

from __future__ import annotations

from fxpipe.ir import PipelinePlan
from fxpipe.options import RunOptions, checkpoint_of_stages
from fxpipe.passes.split.plan import training_overflow
from fxpipe.runtime.config import RunConfig

__all__ = ["resolve_run"]


def resolve_run(plan: PipelinePlan, run: RunOptions) -> RunConfig:
    """``run`` (as the user gave it) resolved against ``plan``: ``chunks`` the plan's by
    default, at most the example batch's samples; ``checkpoint="auto"`` the plan's choice per
    stage, a list of one per stage checked and kept as one mode where all are the same."""
    chunks = min(run.chunks, plan.costs.batch_size) if run.chunks else plan.chunks
    asked = plan.checkpoint_modes if run.checkpoint == "auto" else run.checkpoint
    checkpoint = checkpoint_of_stages(asked, plan.num_stages)
    overflow = (  # planned for inference: what training would need, where it would not fit
        {} if plan.training else training_overflow(plan, chunks=chunks, checkpoint=checkpoint)
    )
    return RunConfig(
        devices=tuple(plan.devices),
        chunks=chunks,
        checkpoint=checkpoint,
        compile=run.compile,
        deferred_batch_norm=run.deferred_batch_norm,
        output_device=run.output_device,
        training_overflow=overflow,
    )
