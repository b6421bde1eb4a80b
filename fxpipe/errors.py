"""Every error and warning fxpipe raises on purpose; each names the value and the remedy."""

from __future__ import annotations

__all__ = [
    "FxPipeError",
    "TraceError",
    "PlanError",
    "ConfigError",
    "InputError",
    "DeviceError",
    "MemoryPlanError",
    "StageError",
    "StageRunError",
    "CheckpointError",
    "UninitialisedError",
    "FxPipeWarning",
    "BatchStatisticsWarning",
    "ChunksWarning",
    "MemoryEstimateWarning",
    "CompileWarning",
]


class FxPipeError(Exception):
    """Base class of every error fxpipe raises on purpose."""


class TraceError(FxPipeError, TypeError):
    """The model could not be captured as a graph by any tracer that was tried."""


class ConfigError(FxPipeError, ValueError):
    """An option passed to fxpipe has a value fxpipe does not accept."""


class DeviceError(FxPipeError, ValueError):
    """A device in ``devices`` is malformed or not present on this machine."""


class PlanError(FxPipeError, ValueError):
    """The graph cannot be split as asked (too many stages, no valid cut)."""


class MemoryPlanError(PlanError):
    """A stage of the plan would not fit in its device's memory."""


class InputError(FxPipeError, ValueError):
    """A call-time or example input does not match what the pipeline was built for."""


class StageError(FxPipeError, RuntimeError):
    """A stage failed in a way that is not the user's own exception (internal)."""


class StageRunError(StageError):
    """A stage raised a torch error while it ran one micro-batch of a call.

    The message says which stage, which micro-batch and which rows of the caller's batch;
    the stage's own exception is the ``__cause__``.
    """


class CheckpointError(FxPipeError, ValueError):
    """A checkpoint cannot be loaded into the pipeline as it is: a path that does not exist,
    a shard its index names that is missing, keys or shapes that differ from the model's."""


class UninitialisedError(FxPipeError, ValueError):
    """A pipeline built on ``meta`` was called while some of its parameters or buffers had
    not been loaded (or initialised in place) since they were made on their stage's device."""


class FxPipeWarning(UserWarning):
    """Base class of every warning fxpipe gives."""


class BatchStatisticsWarning(FxPipeWarning):
    """Layers that use per-batch statistics (BatchNorm in training) see micro-batches, so
    their outputs and running statistics differ from the unpipelined model's."""


class ChunksWarning(FxPipeWarning):
    """A batch smaller than ``chunks`` runs as fewer micro-batches than asked (one per
    sample)."""


class MemoryEstimateWarning(FxPipeWarning):
    """A pipeline planned for inference (the model was in eval mode, or grad was disabled,
    when it was built) is training, and its split would not fit the devices' memory with
    gradients, optimizer state and stashed activations."""


class CompileWarning(FxPipeWarning):
    """A stage asked to run through ``torch.compile`` could not be compiled and runs
    eagerly (its outputs are the same; only its speed differs)."""
