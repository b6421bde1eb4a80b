"""What a rank's pipeline adds for ``generate()``: :class:`Generates`, the methods
:class:`~fxpipe.distributed.rank.runner.DistributedPipeline` takes from it, which refuse what
generation one process per stage does not run, gather a stage's sharded or cut weights whole
for a call, and hand the rest to :class:`fxpipe.generation.ranks.RankGenerator`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.distributed.options import ScheduleOptions
from fxpipe.distributed.parallel.mesh import Layout, comm_device
from fxpipe.distributed.parallel.ownership import full_tensor, is_dtensor, replace_tensors
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
    stages: tuple[Any, ...]
    _generator: RankGenerator | None = None

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``model.generate(...)`` through this pipeline's processes, each stage with its own
        layers' key/value cache and ``lanes`` groups of sequences in flight (see
        :mod:`fxpipe.generation.ranks`). Call it on every rank of the pipeline (each
        replica's ranks under a mesh) with the same arguments; the prompts are read on the
        last stage's rank, and every rank returns the generated sequences. Under
        ``data_parallel="fsdp"`` or tensor parallelism each rank holds its stage's weights
        whole for the call (see :meth:`_whole_stage`; a stage's tp ranks generate alike).
        One stage per rank (ConfigError naming the remedy); a stage made from ``meta`` must
        be loaded first (ConfigError, before any communication)."""
        for stage in self.stages:
            stage.check_loaded()
        if self._generator is None:
            self._generator = self._make_generator()
        with self._whole_stage():
            return self._generator.run(args, kwargs, NO_RECORDER)

    @contextmanager
    def _whole_stage(self) -> Iterator[None]:
        """This rank's stage's Parameters whole for the block, and as they were after (else
        nothing): under FSDP gathered by ``fully_shard``'s own unshard (the replicas' ranks
        all-gather their shards, as a training step's first forward does); under tensor
        parallelism each DTensor Parameter left gathered whole (``full_tensor``, over its
        mesh). The model, the plan's graph and the step variants, which hold the sharded
        Parameters, hold the whole ones for the block; a variant traced in one call reads
        the next call's gathered weights, put in its place again then."""
        from torch.distributed.fsdp import FSDPModule

        modules: list[Any] = [s.submod for s in self.stages if isinstance(s.submod, FSDPModule)]
        if not self.layout.sharded:
            modules = []
        sharded = [dict(m.named_parameters(remove_duplicate=False)) for m in modules]
        for module in modules:
            module.unshard()
        after = [dict(m.named_parameters(remove_duplicate=False)) for m in modules]
        whole = {id(s[k]): w[k] for s, w in zip(sharded, after, strict=True) for k in s}
        held = [*self._model.parameters(), *(t for s in sharded for t in s.values())]
        swap: dict[int, torch.Tensor] = {}
        back: dict[int, torch.Tensor] = {}  # what each held before the block
        for p in dict.fromkeys(held):
            t = whole.get(id(p), p)
            if is_dtensor(t):  # cut over tp (FSDP's whole too, where the stage is also cut)
                t = nn.Parameter(full_tensor(t).detach(), requires_grad=p.requires_grad)
            if t is not p:
                swap[id(p)], back[id(t)] = t, p
        replace_tensors(self._holders(), swap)
        try:
            yield
        finally:
            for module in modules:
                module.reshard()
            replace_tensors(self._holders(), back)

    def _holders(self) -> list[nn.Module]:
        """The model, the plan's graph (steps are split along its borders, found by the
        weights both read) and every step variant's modules: all read the model's tensors."""
        variants = [] if self._generator is None else self._generator.variants
        modules = [m for v in variants for m in (v.plan.graph_module, *v.program.modules)]
        return [self._model, self.plan.graph_module, *modules]

    @property
    def last_generation(self) -> GenerationRun | None:
        """What the last :meth:`generate` ran (lanes, groups, cache bytes per stage)."""
        return None if self._generator is None else self._generator.last

    def _make_generator(self) -> RankGenerator:
        """This rank's generator, once what it cannot run is refused."""
        if len(self.stage_indices) > 1:
            raise ConfigError(
                f"generate() on a distributed pipeline with {len(self.stage_indices)} stages "
                "per rank is not run: build the pipeline for generation with one stage per "
                "rank (stages_per_rank=1)"
            )
        ranks = [dist.get_global_rank(self.group, r) if self.group is not None else r
                 for r in self._ranks]  # fmt: skip
        return RankGenerator(
            self._model, self.plan, self._program, group=self.group, peers=ranks,
            stage=self.stage_indices[0], device=self.device,
            comm=comm_device(self.group, self.device),
        )  # fmt: skip
