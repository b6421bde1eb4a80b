"""Pipeline x data parallel: the ``"pp"`` and ``"dp"`` groups of a 2-D ``DeviceMesh`` (and the
``"tp"`` mesh of a 3-D one), checked before any communication, and each stage module wrapped
for data parallelism over ``"dp"``.

Every pipeline replica (one ``"dp"`` coordinate) makes the same plan over its ``"pp"`` group;
a stage's replicas average their gradients with torch's own ``DistributedDataParallel``
(``"ddp"``: each replica holds the stage's whole parameters) or FSDP2's ``fully_shard``
(``"fsdp"``: each holds a ``1 / dp`` shard of every parameter, a ``DTensor``, gathered for
the stage's micro-batches and released after the last backward). torch's ``PipelineStage``
drives either: gradients are reduced once per step, after the last micro-batch's backward.
A Parameter two stages of one rank read is left whole by FSDP (it wraps each stage alone)
and averaged over ``"dp"`` by ``sync_tied_gradients``. Nothing here communicates by itself.

Under tensor parallelism the Parameters a stage's cut holds are DTensors on ``"tp"``, which
both wrappers take as torch composes them, sliced from one root mesh: ``fully_shard`` over
``"dp"`` makes each a DTensor on the 2-D ``("dp", "tp")`` mesh (FSDP + TP), and DDP's
replicas are torch's ``replicate`` (FSDP2's machinery, replicating over ``"dp"``), since
``DistributedDataParallel`` takes no DTensor Parameters (torch's ``_pre_dp_module_transform``
for it takes the Parameters out of the module at its first forward).
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fxpipe.distributed.options import SPLIT_BACKWARD, ScheduleOptions
from fxpipe.errors import ConfigError

__all__ = [
    "Layout",
    "can_leave_whole",
    "check_sharding",
    "comm_device",
    "mesh_layout",
    "shared_on_a_rank",
]

_Held = TypeVar("_Held", bound=Hashable)


@dataclass(frozen=True)
class Layout:
    """The groups a rank's pipeline uses: its ``"pp"`` group (the stages of one replica;
    None: the world) and its ``"dp"`` group (the same stage in every replica; None: one
    replica)."""

    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None = None
    dp_size: int = 1
    data_parallel: str = "ddp"
    dp_mesh: Any = None  # the 1-D "dp" DeviceMesh, for fully_shard and replicate
    #: The 1-D ``"tp"`` DeviceMesh each stage is cut over (tensor parallelism); None: none.
    tp_mesh: Any = None

    @property
    def sharded(self) -> bool:
        """Whether the stages' parameters are sharded over ``"dp"`` (FSDP2)."""
        return self.dp_group is not None and self.data_parallel == "fsdp"

    @property
    def replaces_parameters(self) -> bool:
        """Whether wrapping a stage puts DTensor Parameters in place of its own: FSDP2's
        ``fully_shard``, or torch's ``replicate`` (DDP's replicas under tensor parallelism)."""
        return self.sharded or (self.dp_group is not None and self.tp_mesh is not None)

    def wrap(
        self,
        module: nn.Module,
        device: torch.device,
        whole: Collection[nn.Parameter] = (),
        *,
        find_unused: bool = True,
    ) -> nn.Module:
        """``module`` as its stage's replicas train it: under DDP or ``fully_shard`` over
        ``"dp"``, else as is. DDP does not broadcast buffers each forward (one collective
        per micro-batch): the replicas start equal and update them alike, except batch-norm
        running statistics, which each updates from its own micro-batches (warned about at
        the first step). With ``find_unused`` (a stage that holds a weight it reads for its
        shape or dtype alone: Hugging Face's ``x.to(self.weight.dtype)``, BiT's
        ``reshape_as(self.weight)``, export's dtype asserts; its gradient comes from another
        stage) DDP looks for the Parameters its stage gives no gradient each step
        (``find_unused_parameters=True``); without the search DDP would wait for that
        gradient, reduce none of the stage's, and the replicas would silently part (DDP's
        error comes a step later). Other stages skip the search (and torch's warning that
        it found nothing). Under tensor parallelism (``tp_mesh``) DDP's replicas are
        torch's ``replicate`` over ``"dp"`` instead (DistributedDataParallel takes no
        DTensor Parameters): FSDP2's machinery unsharded, each Parameter a DTensor
        replicated over ``"dp"`` and cut over ``"tp"``, its gradient averaged over ``"dp"``
        once per step; ``whole`` left out of it as ``fully_shard`` leaves them.
        ``fully_shard`` keeps the gathered parameters from the first forward to the last
        backward of a step (``reshard_after_forward=False``: one gather per step, not one
        per micro-batch), and leaves the Parameters of ``whole`` whole (unsharded, not
        reduced: see :func:`check_sharding`). A stage with nothing to
        average or shard (no Parameters that train: DDP refuses such a module) is left as
        it is."""
        if self.dp_group is None:
            return module
        if self.replaces_parameters:
            kept = {id(w) for w in whole}
            if all(id(p) in kept for p in module.parameters()):
                return module  # nothing to shard (a stage of no Parameters, or only whole)
            ignored = {"ignored_params": set(whole)} if whole else {}
            if not self.sharded:
                _replicate(self.dp_size, self.tp_mesh.size())(module, mesh=self.dp_mesh, **ignored)
                return module
            shard = _fully_shard()
            shard(module, mesh=self.dp_mesh, reshard_after_forward=False, **ignored)
            return module
        if not any(p.requires_grad for p in module.parameters()):
            return module  # nothing to average (and DDP refuses such a module)
        # newer torch spells broadcast_buffers=False as forward_sync_buffers=False
        newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        no_sync: dict[str, Any] = {"forward_sync_buffers" if newer else "broadcast_buffers": False}
        return DistributedDataParallel(
            module,
            device_ids=[device] if device.type == "cuda" else None,
            process_group=self.dp_group,
            find_unused_parameters=find_unused,
            **no_sync,
        )


def check_sharding(
    layout: Layout, modules: Sequence[nn.Module], ranks: Sequence[int]
) -> frozenset[int]:
    """The ids of the Parameters FSDP must leave whole: each read by two stages of one rank
    (a tied embedding and head under a V-shaped schedule, a block called at two depths
    under a looped one), which ``fully_shard`` cannot shard for both of the stages it wraps
    alone. Such a Parameter is left whole on every rank holding it (one plan, so every rank
    decides alike), and ``sync_tied_gradients`` averages its gradient over ``"dp"``. So
    too under torch's ``replicate`` (DDP's replicas under tensor parallelism), which wraps
    each stage alike. Empty otherwise; ConfigError where this torch's ``fully_shard``
    cannot leave a Parameter out (no ``ignored_params``)."""
    if not layout.replaces_parameters:
        return frozenset()
    found = shared_on_a_rank([{id(p) for p in m.parameters()} for m in modules], ranks)
    if found and layout.sharded and not can_leave_whole():
        key, (k, j) = next(iter(found.items()))
        name = next(n for n, p in modules[j].named_parameters() if id(p) == key)
        raise ConfigError(
            f"parameter {name!r} is read by stages {k} and {j}, which are both on "
            f"pipeline rank {ranks[j]}; data_parallel='fsdp' shards each stage alone, and "
            f"torch {torch.__version__}'s fully_shard cannot leave it out "
            "(ignored_params): pass data_parallel='ddp', stages_per_rank=1, or upgrade torch"
        )
    return frozenset(found)


def shared_on_a_rank(
    held: Sequence[Collection[_Held]], ranks: Sequence[int]
) -> dict[_Held, tuple[int, int]]:
    """Everything two stages of one rank both hold (``held[j]``: what stage ``j`` holds,
    ``ranks[j]``: its rank), each with the first two such stages; in stage order. What
    FSDP cannot shard for each stage alone."""
    first: dict[tuple[_Held, int], int] = {}  # (thing, rank) -> the first stage holding it
    found: dict[_Held, tuple[int, int]] = {}
    for j, things in enumerate(held):
        for thing in things:
            k = first.setdefault((thing, ranks[j]), j)
            if k != j:
                found.setdefault(thing, (k, j))
    return found


def mesh_layout(mesh: Any, group: dist.ProcessGroup | None, options: ScheduleOptions) -> Layout:
    """The layout of ``mesh`` (None: one pipeline over ``group``) for ``options``;
    ConfigError, before any communication, for a mesh without ``"pp"`` and ``"dp"``
    dimensions, a mesh beside a ``group``, or a schedule its ``data_parallel`` cannot
    follow (or FSDP on a torch without it)."""
    data_parallel, schedule = options.data_parallel, options.schedule
    if data_parallel == "fsdp":
        _fully_shard()  # this torch has it
    if mesh is None:
        if options.tensor_parallel is not None:
            raise ConfigError(
                f"tensor_parallel={options.tensor_parallel!r} needs a mesh with a 'tp' "
                "dimension; pass mesh=init_device_mesh(device_type, (pp, dp, tp), "
                "mesh_dim_names=('pp', 'dp', 'tp'))"
            )
        return Layout(group)
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise ConfigError(
            f"mesh is a {type(mesh).__name__}, not a torch DeviceMesh; make one with "
            "torch.distributed.device_mesh.init_device_mesh(device_type, (pp, dp), "
            "mesh_dim_names=('pp', 'dp'))"
        )
    names = _check_dims(mesh, options.tensor_parallel)
    if mesh.size() != dist.get_world_size():
        raise ConfigError(
            f"mesh spans {mesh.size()} ranks but the world has {dist.get_world_size()}; "
            "make the mesh over every rank (init_device_mesh(device_type, (pp, dp)) with "
            "pp * dp == world size)"
        )
    if group is not None:
        raise ConfigError(
            "both mesh and group were given; the pipeline's group is the mesh's 'pp' "
            "dimension: pass mesh alone"
        )
    if schedule in SPLIT_BACKWARD:
        _check_split_backward(schedule, data_parallel)
    dp = mesh["dp"]
    size = dp.size()
    group = dp.get_group() if size > 1 else None
    tp = mesh["tp"] if "tp" in names else None
    if tp is not None and size > 1 and data_parallel == "ddp":
        _replicate(size, tp.size())  # this torch has it
    return Layout(mesh["pp"].get_group(), group, size, data_parallel, dp, tp)


def _check_dims(mesh: Any, tensor_parallel: object) -> tuple[str, ...]:
    """The mesh's dimension names; ConfigError unless they are ``("pp", "dp")``, or
    ``("pp", "dp", "tp")`` with ``tensor_parallel="auto"``."""
    names = tuple(mesh.mesh_dim_names or ())
    if tensor_parallel is None:
        if mesh.ndim != 2 or set(names) != {"pp", "dp"}:
            tp = " (a 'tp' dimension needs tensor_parallel='auto')" if "tp" in names else ""
            raise ConfigError(
                f"mesh has dimensions {names or mesh.ndim} but a 2-D mesh named ('pp', 'dp') "
                f"is needed{tp}; make it with init_device_mesh(device_type, (pp, dp), "
                "mesh_dim_names=('pp', 'dp'))"
            )
    elif mesh.ndim != 3 or set(names) != {"pp", "dp", "tp"}:
        raise ConfigError(
            f"tensor_parallel={tensor_parallel!r} but mesh has dimensions {names or mesh.ndim}; "
            "tensor parallelism needs a 3-D mesh named ('pp', 'dp', 'tp'): make it with "
            "init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=('pp', 'dp', 'tp'))"
        )
    return names


def _check_split_backward(schedule: str, data_parallel: str) -> None:
    """ConfigError for a zero-bubble schedule under DDP, or under FSDP on a torch whose
    pipeline stages do not reduce FSDP's gradients after the weight parts."""
    if data_parallel == "ddp":
        raise ConfigError(
            f"schedule={schedule!r} splits backward into input and weight parts, which "
            "DDP's gradient hooks do not follow (its all-reduce would miss the weight "
            "parts); pass data_parallel='fsdp', or use 'gpipe', '1f1b', 'interleaved1f1b' or "
            "'loopedbfs' with DDP"
        )
    from torch.distributed.pipelining import PipelineStage

    if not hasattr(PipelineStage, "perform_reduce_grad"):
        raise ConfigError(
            f"schedule={schedule!r} with data_parallel='fsdp' needs torch's pipeline stages "
            "to reduce FSDP's gradients once every weight part has run "
            f"(PipelineStage.perform_reduce_grad), which torch {torch.__version__} lacks; "
            "upgrade torch, or use 'gpipe', '1f1b', 'interleaved1f1b' or 'loopedbfs'"
        )


def can_leave_whole() -> bool:
    """Whether this torch's ``fully_shard`` can leave Parameters out (``ignored_params``)."""
    return "ignored_params" in inspect.signature(_fully_shard()).parameters


def _fully_shard() -> Any:
    """FSDP2's ``fully_shard``; ConfigError on a torch without it."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        raise ConfigError(
            f"data_parallel='fsdp' needs FSDP2's fully_shard (torch >= 2.6), which torch "
            f"{torch.__version__} does not have; upgrade torch or pass data_parallel='ddp'"
        ) from None
    return fully_shard


def _replicate(dp: int, tp: int) -> Any:
    """torch's ``replicate`` (DDP's replicas on FSDP2's machinery, which takes the DTensor
    Parameters tensor parallelism makes), as torch's pipeline stages drive it; ConfigError
    on a torch without it."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError:
        raise ConfigError(
            f"data_parallel='ddp' over a mesh of dp={dp} and tp={tp} needs torch's replicate "
            "(torch.distributed._composable.replicate_with_fsdp: DistributedDataParallel "
            f"takes no DTensor Parameters), which torch {torch.__version__} does not have; "
            "pass data_parallel='fsdp', or upgrade torch"
        ) from None
    return replicate


def comm_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where collectives of ``group`` put their tensors: the stage device under NCCL."""
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")
