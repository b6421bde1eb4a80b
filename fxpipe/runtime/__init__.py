"""The single-process GPipe runtime: it runs a StageProgram over micro-batches on devices.

- ``schedule``: the clock-cycle schedule, as data.
- ``microbatch``: scatter a mini-batch into micro-batches; gather outputs back.
- ``stream``: CPU and CUDA streams behind one interface.
- ``worker``: one worker thread per device; tasks carry grad mode and autocast.
- ``phony``: cached empty tensors that only carry autograd edges.
- ``dependency``: fork/join, so micro-batches go backward in reverse order.
- ``copy``: Copy/Wait autograd Functions on copy streams.
- ``checkpoint``: Checkpoint/Recompute, with the RNG state restored.
- ``batchnorm``: deferred BatchNorm running statistics.
- ``recording``: what the executor tells a recorder (nothing is recorded by default), and
  the Recorder that times every task for ``fxpipe.record``.
- ``executor``: the Executor that ties them together.
"""

from __future__ import annotations

from fxpipe.runtime.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
from fxpipe.runtime.checkpoint import is_checkpointing, is_recomputing
from fxpipe.runtime.executor import Executor
from fxpipe.runtime.microbatch import gather, scatter

__all__ = [
    "DeferredBatchNorm",
    "Executor",
    "convert_deferred_batch_norm",
    "gather",
    "is_checkpointing",
    "is_recomputing",
    "scatter",
]
