"""What a rank's pipeline adds for ``generate()``: :class:`Generates`, the methods
:class:`~fxpipe.distributed.rank.runner.DistributedPipeline` takes from it, which refuse what
generation one process per stage does not run and hand the rest to
:class:`fxpipe.generation.ranks.RankGenerator`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.distributed.options import ScheduleOptions
from fxpipe.distributed.parallel.mesh import Layout, comm_device
from fxpipe.errors import ConfigError
from fxpipe.generation.driver import GenerationRun
from fxpipe.generation.ranks import RankGenerator
from fxpipe.ir import PipelinePlan, StageProgram
from fxpipe.passes.tensor.records import TensorPlan
from fxpipe.runtime.recording import NO_RECORDER

__all__ = ["Generates"]


class Generates:
    """``generate()`` and ``last_generation`` of a distributed pipeline (the attributes
    below are the pipeline's)."""

    plan: PipelinePlan
    group: dist.ProcessGroup | None
    device: torch.device
    options: ScheduleOptions
    layout: Layout
    tensor_plan: TensorPlan | None
    stage_indices: tuple[int, ...]
    _model: nn.Module
    _program: StageProgram
    _ranks: tuple[int, ...]
    _generator: RankGenerator | None = None

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``model.generate(...)`` through this pipeline's processes, each stage with its own
        layers' key/value cache and ``lanes`` groups of sequences in flight (see
        :mod:`fxpipe.generation.ranks`). Call it on every rank of the pipeline (each
        replica's ranks under a mesh) with the same arguments; the prompts are read on the
        last stage's rank, and every rank returns the generated sequences. One stage per
        rank, without tensor parallelism or FSDP (ConfigError naming the remedy)."""
        if self._generator is None:
            self._generator = self._make_generator()
        return self._generator.run(args, kwargs, NO_RECORDER)

    @property
    def last_generation(self) -> GenerationRun | None:
        """What the last :meth:`generate` ran (lanes, groups, cache bytes per stage)."""
        return None if self._generator is None else self._generator.last

    def _make_generator(self) -> RankGenerator:
        """This rank's generator, once what it cannot run is refused."""
        refused = (
            (self.tensor_plan is not None, "tensor parallelism (the step is traced whole)"),
            (self.layout.replaces_parameters, f"data_parallel={self.options.data_parallel!r} "
             "(its Parameters are sharded DTensors)"),
            (len(self.stage_indices) > 1, f"{len(self.stage_indices)} stages per rank"),
        )  # fmt: skip
        for found, what in refused:
            if found:
                raise ConfigError(
                    f"generate() on a distributed pipeline with {what} is not run: build the "
                    "pipeline for generation with one stage per rank (stages_per_rank=1), "
                    "tensor_parallel=None and data_parallel='ddp'"
                )
        ranks = [dist.get_global_rank(self.group, r) if self.group is not None else r
                 for r in self._ranks]  # fmt: skip
        return RankGenerator(
            self._model, self.plan, self._program, group=self.group, peers=ranks,
            stage=self.stage_indices[0], device=self.device,
            comm=comm_device(self.group, self.device),
        )  # fmt: skip
