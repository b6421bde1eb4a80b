"""The ``parallelize_module`` style of each module a local program calls at a cut product.

An unfused product over an (out, in) weight and an embedding take torch's own styles:
``ColwiseParallel``, ``RowwiseParallel``, an LM head ``ColwiseParallel(output_layouts=
Replicate())``, a vocabulary-parallel embedding ``RowwiseParallel(input_layouts=
Replicate())``. Two cuts those styles cannot place are subclasses of them that change only
how the parameters are placed, keeping torch's input and output handling (and so its
collectives): a weight stored (in, out) (transformers' ``Conv1D``: column-wise cuts dim 1,
row-wise dim 0), and a fused q, k, v cut in parts (``Shard(dim, blocks=3)``: each rank holds
its piece of q, of k and of v). The fused weight is placed as torch's ``_StridedShard(dim,
split_factor=blocks)``, whose global tensor is the model's own weight in its own order (so a
gathered gradient or a saved checkpoint reads as the unsharded model's) and whose local
piece is the plan's; ``_StridedShard`` is private to torch (FSDP uses it under tensor
parallelism), so a torch upgrade may move it.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor import distribute_tensor as _distribute
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from fxpipe.passes.tensor import records
from fxpipe.passes.tensor.cut_modules import Cut, CutEmbedding, CutLinear, cut_of

__all__ = ["style_of", "placement_of", "PlacedColwise", "PlacedRowwise"]


def placement_of(shard: records.Shard | None) -> Placement:
    """The DTensor placement of a parameter the plan cuts as ``shard`` (None: whole)."""
    if shard is None:
        return Replicate()
    if shard.blocks == 1:
        return Shard(shard.dim)
    return _StridedShard(shard.dim, split_factor=shard.blocks)


def style_of(module: nn.Module) -> ParallelStyle:
    """The style that cuts a generated module as its plan says."""
    cut = cut_of(module)
    if cut is None:
        raise TypeError(f"{type(module).__name__} is not a module a local program generates")
    # a value cut along the sequence: a row-wise sum reduce-scattered along it, kept a
    # DTensor (the region runs on DTensors); a column-wise input all-gathered from it
    sequence = None if cut.sequence is None else Shard(cut.sequence)
    if isinstance(module, CutEmbedding):
        if sequence is not None:
            return RowwiseParallel(
                input_layouts=Replicate(), output_layouts=sequence, use_local_output=False
            )
        return RowwiseParallel(input_layouts=Replicate())
    plain = isinstance(module, CutLinear) and (cut.weight is None or cut.weight.blocks == 1)
    if cut.style == "rowwise":
        if sequence is not None:
            if plain:
                return RowwiseParallel(output_layouts=sequence, use_local_output=False)
            return PlacedRowwise(cut, output_layouts=sequence)
        return RowwiseParallel() if plain else PlacedRowwise(cut)
    gathered = Replicate() if cut.style == "gathered" else None
    if plain:
        return ColwiseParallel(input_layouts=sequence, output_layouts=gathered)
    return PlacedColwise(cut, input_layouts=sequence, output_layouts=gathered)


def _place(
    module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], rank: int | None
) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        placed = _distribute(param, mesh, [placements[name]], src_data_rank=rank)
        module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))


class PlacedColwise(ColwiseParallel):
    """``ColwiseParallel`` with the weight and bias placed as the plan cuts them; the output
    stays as cut, the rank's own output features (or gathered whole, for an LM head)."""

    def __init__(
        self,
        cut: Cut,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
    ) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts)
        self.placements = {"weight": placement_of(cut.weight), "bias": placement_of(cut.bias)}

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name == "":  # the module itself (it has no children)
            _place(module, mesh, self.placements, self.src_data_rank)

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, mesh: Any
    ) -> Any:
        assert isinstance(outputs, DTensor)
        if output_layouts == (Replicate(),):
            outputs = outputs.redistribute(placements=output_layouts)
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _with_style(self, module, device_mesh)


class PlacedRowwise(RowwiseParallel):
    """``RowwiseParallel`` with the weight placed as the plan cuts it (its bias whole, added
    once to the all-reduced sum); with ``output_layouts`` a ``Shard`` of the sequence, the
    sum is reduce-scattered along it and left a DTensor."""

    def __init__(self, cut: Cut, *, output_layouts: Placement | None = None) -> None:
        if output_layouts is None:
            super().__init__()
        else:
            super().__init__(output_layouts=output_layouts, use_local_output=False)
        self.placements = {"weight": placement_of(cut.weight), "bias": Replicate()}
        self.desired_input_layouts = (Shard(-1),)

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name == "":  # the module itself (it has no children)
            _place(module, mesh, self.placements, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _with_style(self, module, device_mesh)


def _with_style(style: Any, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``distribute_module`` as torch's own styles call it: ``style``'s placement of the
    parameters (its ``_partition``) and its preparation of the inputs and outputs."""
    return distribute_module(
        module,
        mesh,
        style._partition,
        lambda m, inputs, mesh: style._prepare_input_fn(
            style.input_layouts, style.desired_input_layouts, m, inputs, mesh
        ),
        lambda m, outputs, mesh: style._prepare_output_fn(
            style.output_layouts, style.use_local_output, m, outputs, mesh
        ),
    )
