"""Pipeline x data parallel: the ``"pp"`` and ``"dp"`` groups of a 2-D ``DeviceMesh``, checked
before any communication, and each stage module wrapped for data parallelism over ``"dp"``.

Every pipeline replica (one ``"dp"`` coordinate) makes the same plan over its ``"pp"`` group;
a stage's replicas average their gradients with torch's own ``DistributedDataParallel``,
whose last-micro-batch synchronisation torch's ``PipelineStage`` drives (``no_sync`` for the
others). Nothing here communicates by itself.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fxpipe.errors import ConfigError

__all__ = ["DATA_PARALLEL", "Layout", "mesh_layout"]

#: ``data_parallel=`` values: torch's DDP over the ``"dp"`` group.
DATA_PARALLEL = ("ddp",)
#: Schedules that split backward into input and weight parts, which DDP's one hook per
#: parameter does not follow.
_SPLIT_BACKWARD = frozenset({"interleavedzerobubble", "zbvzerobubble", "dualpipev"})


@dataclass(frozen=True)
class Layout:
    """The groups a rank's pipeline uses: its ``"pp"`` group (the stages of one replica;
    None: the world) and its ``"dp"`` group (the same stage in every replica; None: one
    replica)."""

    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None = None
    dp_size: int = 1

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        """``module`` as its stage's replicas train it: under DDP over ``"dp"``, else as is.
        Buffers are not broadcast each forward (one collective per micro-batch): the
        replicas start equal and update them alike."""
        if self.dp_group is None:
            return module
        # newer torch spells broadcast_buffers=False as forward_sync_buffers=False
        newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        no_sync: dict[str, Any] = {"forward_sync_buffers" if newer else "broadcast_buffers": False}
        return DistributedDataParallel(
            module,
            device_ids=[device] if device.type == "cuda" else None,
            process_group=self.dp_group,
            **no_sync,
        )


def mesh_layout(
    mesh: Any, group: dist.ProcessGroup | None, data_parallel: str, schedule: str
) -> Layout:
    """The layout of ``mesh`` (None: one pipeline over ``group``); ConfigError, before any
    communication, for a mesh without ``"pp"`` and ``"dp"`` dimensions, a mesh beside a
    ``group``, an unknown ``data_parallel`` or a schedule DDP cannot follow."""
    if data_parallel not in DATA_PARALLEL:
        raise ConfigError(
            f"data_parallel={data_parallel!r} is not one of {DATA_PARALLEL}; pass 'ddp' "
            "(torch's DistributedDataParallel over the mesh's 'dp' dimension)"
        )
    if mesh is None:
        return Layout(group)
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise ConfigError(
            f"mesh is a {type(mesh).__name__}, not a torch DeviceMesh; make one with "
            "torch.distributed.device_mesh.init_device_mesh(device_type, (pp, dp), "
            "mesh_dim_names=('pp', 'dp'))"
        )
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or set(names) != {"pp", "dp"}:
        raise ConfigError(
            f"mesh has dimensions {names or mesh.ndim} but a 2-D mesh named ('pp', 'dp') is "
            "needed; make it with init_device_mesh(device_type, (pp, dp), "
            "mesh_dim_names=('pp', 'dp'))"
        )
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
    if schedule in _SPLIT_BACKWARD:
        raise ConfigError(
            f"schedule={schedule!r} splits backward into input and weight parts, which "
            "data parallelism over the mesh does not follow yet; use 'gpipe', '1f1b', "
            "'interleaved1f1b' or 'loopedbfs' with a mesh"
        )
    dp = mesh["dp"]
    size = dp.size()
    return Layout(mesh["pp"].get_group(), dp.get_group() if size > 1 else None, size)
