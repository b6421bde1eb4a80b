"""A stage's local program cut over a tp mesh by torch's own tensor parallelism."""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from fxpipe.errors import ConfigError
from fxpipe.passes.tensor.cut_modules import ReplicatedRead, SequenceEntry, cut_of
from fxpipe.passes.tensor.local import local_program
from fxpipe.passes.tensor.records import TensorPlan
from fxpipe.passes.tensor.styles import style_of

__all__ = ["parallelize_stage", "parallelize_program", "local_styles"]

LOGGER = logging.getLogger("fxpipe")


def parallelize_stage(gm: fx.GraphModule, plan: TensorPlan, tp_mesh: DeviceMesh) -> fx.GraphModule:
    """``gm``'s :func:`~fxpipe.passes.tensor.local.local_program` with its cut products
    parallelized over ``tp_mesh`` (a 1-D mesh of ``plan.tp`` ranks) by ``parallelize_module``:
    the Parameters the plan cuts become DTensors (one Parameter still where the model ties a
    weight to two products: an embedding and its LM head, both cut over the vocabulary, so
    its gradient sums both uses); those it leaves whole stay plain tensors, the same on
    every rank (each rank computes the same gradient for them), and are the model's own.
    Between the product modules the program runs on plain local tensors. Products the plan
    leaves whole (a head count tp does not divide) run whole on every rank; they are logged
    to the ``fxpipe`` logger with the plan's reason, and ``meta["tensor_plan"]`` of the
    returned module holds the plan (its ``summary()`` says what is cut how).
    Call it on every rank of ``tp_mesh`` (placing the weights communicates)."""
    if tp_mesh.ndim != 1:
        raise ConfigError(
            f"tp_mesh has {tp_mesh.ndim} dimensions {tp_mesh.mesh_dim_names}; pass the 1-D "
            'tensor-parallel sub-mesh (mesh["tp"])'
        )
    if tp_mesh.size() != plan.tp:
        raise ConfigError(
            f"the plan cuts over tp={plan.tp} ranks but tp_mesh has {tp_mesh.size()}; plan "
            f"again with tensor_plan(gm, {tp_mesh.size()}, example_values)"
        )
    local = local_program(gm, plan)
    parallelize_program(local, tp_mesh)
    for node, why in plan.replicated.items():
        LOGGER.info("tensor parallel: %s runs whole on every tp rank: %s", node, why)
    local.meta["tensor_plan"] = plan
    return local


def parallelize_program(local: fx.GraphModule, tp_mesh: DeviceMesh) -> dict[int, nn.Parameter]:
    """Cut a local program's generated modules over ``tp_mesh`` in place; the id of each
    Parameter they held (the model's) -> the DTensor Parameter now in its place. Each cut
    Parameter's gradient is kept placed as the Parameter is."""
    before = {
        (path, name): p
        for path, m in local.named_modules()
        if cut_of(m) is not None
        for name, p in m.named_parameters(recurse=False)
    }
    shared = _holders(local)
    parallelize_module(local, tp_mesh, local_styles(local))
    for m in local.modules():  # where whole values meet cut ones (along the sequence, or not)
        if isinstance(m, (SequenceEntry, ReplicatedRead)):
            m.mesh = tp_mesh
    _tie_again(local, shared)
    for p in {id(p): p for p in local.parameters() if isinstance(p, DTensor)}.values():
        p.register_post_accumulate_grad_hook(_placed_like_param)  # type: ignore[no-untyped-call]
    return {
        id(old): local.get_submodule(path).get_parameter(name)
        for (path, name), old in before.items()
    }


def local_styles(local: fx.GraphModule) -> dict[str, ParallelStyle]:
    """Module path -> ``parallelize_module`` style, for every module a local program
    generated."""
    return {path: style_of(m) for path, m in local.named_modules() if cut_of(m) is not None}


def _placed_like_param(param: torch.Tensor) -> None:
    """Keep a cut Parameter's gradient placed as the Parameter is: a lookup over the
    vocabulary leaves its table's gradient as partial sums, which an optimizer and the
    pipeline's sum of tied gradients would take for this rank's rows."""
    grad = param.grad
    assert isinstance(param, DTensor) and isinstance(grad, DTensor)
    if grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _holders(local: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The generated modules' parameters held by more than one of them: each as the
    (module, name) pairs holding it."""
    by_param: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, m in local.named_modules():
        if cut_of(m) is None:
            continue
        for name, p in m.named_parameters(recurse=False):
            by_param.setdefault(id(p), []).append((m, name))
    return [h for h in by_param.values() if len(h) > 1]


def _tie_again(local: nn.Module, shared: list[list[tuple[nn.Module, str]]]) -> None:
    """``parallelize_module`` gives each module a DTensor of its own; modules that held one
    Parameter hold the first one's again (each is cut alike, or tying would be wrong)."""
    for holders in shared:
        first_module, first_name = holders[0]
        first = getattr(first_module, first_name)
        assert isinstance(first, DTensor) and isinstance(first, nn.Parameter)
        for module, name in holders[1:]:
            other = getattr(module, name)
            if other.placements != first.placements or other.device_mesh != first.device_mesh:
                raise ConfigError(
                    f"one weight is cut as {first.placements} for one product and "
                    f"{other.placements} for another; a tied weight must be cut alike"
                )
            module.register_parameter(name, first)
