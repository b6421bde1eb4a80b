"""``fxpipe.Pipeline``: the drop-in ``nn.Module`` over a compiled model's run-time session.

The user's model stays the single owner of every Parameter and buffer: they move in place
to their stage's device, ``parameters()`` yields them, and ``state_dict()`` has exactly
the model's keys. The stage GraphModules reference the same objects. What runs, and how,
is the session's (:mod:`fxpipe.runtime.session`); this module is what trainers see.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fxpipe.errors import ConfigError
from fxpipe.generation import GenerationRun, Generator
from fxpipe.interop.trainers import DropIn
from fxpipe.ir import CheckpointMode, Checkpoints, PipelinePlan
from fxpipe.options import checkpoint_of_stages
from fxpipe.runtime.compiled import StageCompilation
from fxpipe.runtime.recording import NO_RECORDER, RunRecorder
from fxpipe.runtime.session import Session
from fxpipe.runtime.variants import Variant
from fxpipe.trace.tracing import Traced
from fxpipe.weights.materialise import Materialised
from fxpipe.weights.state import unshared

__all__ = ["Pipeline"]


class Pipeline(DropIn):
    """A model split into stages over devices, run as a GPipe pipeline of micro-batches
    (made by :func:`fxpipe.pipeline`): what the model returns, with the same gradients and
    the model's own parameters and state dict. ``plan``, ``stages``, ``devices``, ``chunks``,
    ``checkpoint``, ``output_device``; ``module`` is the user's model."""

    def __init__(self, model: nn.Module, plan: PipelinePlan, session: Session) -> None:
        super().__init__()
        self.module, self.plan, self._session = model, plan, session
        self.devices = session.config.devices
        self.chunks = session.config.chunks
        self.output_device = session.config.output_device
        self.training = model.training
        self._generator: Generator | None = None
        self._stand_in_for(model)  # forward's signature, to(), config...: fxpipe.interop.trainers

    @property
    def _traced(self) -> Traced:
        return self._session.variants.first.traced

    @property
    def variants(self) -> tuple[Variant, ...]:
        """Every form of the model this pipeline runs: the first (its plan is :attr:`plan`),
        then one per other set of modes or call structure (:mod:`fxpipe.runtime.variants`)."""
        return tuple(self._session.variants.all)

    @property
    def compilation(self) -> tuple[StageCompilation, ...]:
        """With ``compile=``: what compiling each stage of each variant came to (graphs,
        seconds, or why it runs eagerly); empty without."""
        return self._session.compilation

    @property
    def stages(self) -> tuple[torch.fx.GraphModule, ...]:
        """The stage GraphModules, in pipeline order (``stages[j]`` runs on ``devices[j]``)."""
        return self._session.variants.first.program.modules

    @property
    def checkpoint(self) -> Checkpoints:
        """Which micro-batches each stage recomputes in backward (a mode, or one per stage
        where they differ); settable alike, from the next call."""
        return self._session.checkpoint

    @checkpoint.setter
    def checkpoint(self, mode: CheckpointMode | Sequence[CheckpointMode]) -> None:
        self._session.set_checkpoint(checkpoint_of_stages(mode, self.plan.num_stages))

    @property
    def use_threads(self) -> bool:
        """Whether stages run in one worker thread per device (by default where they span
        several devices; settable)."""
        return self._session.use_threads

    @use_threads.setter
    def use_threads(self, value: bool) -> None:
        self._session.use_threads = value

    @contextmanager
    def attach_recorder(self, recorder: RunRecorder) -> Iterator[None]:
        """Within a ``with`` block, tell ``recorder`` (a
        :class:`fxpipe.runtime.recording.RunRecorder`, such as the one :func:`fxpipe.record`
        attaches) about every run, cell and transfer; detached when the block ends, also
        when it raises. ConfigError where another recorder is attached (one at a time)."""
        self._session.set_recorder(recorder)
        try:
            yield
        finally:
            self._session.set_recorder(NO_RECORDER)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``model(*args, **kwargs)`` as micro-batches through the stages, in the model's
        structure, on ``output_device`` (default: the first tensor's device), in the modes the
        model's modules are in (a new mode or call structure: a new variant first). Arguments
        are checked against what the trace fixed (``InputError``); an error inside a stage
        names the stage, the micro-batch and its rows (``StageRunError``)."""
        return self._session.run(args, kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``model.generate(...)`` through the stages: each stage keeps its own layers'
        key/value cache on its device, and ``lanes`` groups of ``sequences_per_lane`` rows
        are in flight at once, long prompts in steps of ``prefill_chunk`` tokens
        (:mod:`fxpipe.generation`); the model's forward does not
        generate (it runs once, over two positions, to learn each layer's cache). Greedy
        search and beam search give the model's own tokens. A model built on ``meta`` must
        be loaded first (:class:`~fxpipe.errors.UninitialisedError`)."""
        self._session.check_loaded()  # before tracing a step: nothing runs on empty memory
        if self._generator is None:
            first = self._session.variants.first
            self._generator = Generator(self.module, first.plan, first.program)
        return self._generator.generate(args, kwargs, recorder=self._session.recorder)

    @property
    def last_generation(self) -> GenerationRun | None:
        """What the last :meth:`generate` ran: lanes, groups, cache length and bytes per
        stage (None before the first)."""
        return None if self._generator is None else self._generator.last

    def train(self, mode: bool = True) -> Pipeline:
        """Set training mode (``mode=False``: eval) on the pipeline, its stages and the model;
        the next call runs the model in that mode."""
        super().train(mode)
        self._session.train(mode)
        return self

    @property
    def materialised(self) -> Materialised:
        """For a model built on ``meta``: which of its tensors were made on their stage's
        device and which are still unloaded (``fxpipe.load_checkpoint`` marks them)."""
        return self._session.materialised

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own state dict (its keys, its values); a tensor it holds under several
        names (a tied LM head) is a copy under the later ones, as a file holds it
        (:func:`fxpipe.weights.state.unshared`); ``keep_vars=True``: the model's own."""
        state = self.module.state_dict(*args, **kwargs)
        if kwargs.get("keep_vars") or (len(args) > 2 and args[2]):
            return state
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        return unshared(state, str(prefix))

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load the model's own checkpoint; values are copied onto each stage's device. A
        model built on ``meta`` also takes its non-persistent buffers here."""
        if assign:
            raise ConfigError(
                "load_state_dict(assign=True) would replace the Parameters the stages hold; "
                "use assign=False"
            )
        return self.materialised.load_state_dict(self.module, state_dict, strict)

    def extra_repr(self) -> str:
        """What ``repr(pipe)`` shows beside the model: stages, devices, chunks, checkpoint."""
        devices = ", ".join(str(d) for d in self.devices)
        return (
            f"stages={len(self.devices)}, devices=[{devices}], chunks={self.chunks}, "
            f"checkpoint={self.checkpoint!r}"
        )
