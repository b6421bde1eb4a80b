"""The modules a tensor-parallel local program calls where its plan cuts a matrix product or
an embedding: each holds the model's own Parameters and records how the plan cuts them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from fxpipe.errors import ConfigError
from fxpipe.passes.tensor.records import NodeStyle, Shard

__all__ = [
    "Cut",
    "CutLinear",
    "CutInOut",
    "CutEmbedding",
    "CutModule",
    "SequenceEntry",
    "ReplicatedRead",
    "cut_of",
    "gathered",
    "local",
]


@dataclass(frozen=True, slots=True)
class Cut:
    """How the plan cuts the parameters of one generated module over the tp ranks."""

    #: The graph node the module stands for.
    node: str
    style: NodeStyle
    #: The plan's cut of the weight and of the bias (None: whole on every rank).
    weight: Shard | None
    bias: Shard | None
    #: The sequence dimension a row-wise product or an embedding reduce-scatters its sums
    #: along (its output a DTensor cut along it); None: all-reduced.
    sequence: int | None = None


class CutLinear(nn.Linear):
    """``x @ W.T + b`` over a weight stored (out, in), as ``nn.Linear`` computes it (torch's
    ``ColwiseParallel`` and ``RowwiseParallel`` take it)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, cut: Cut) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.weight = weight
        self.register_parameter("bias", bias)
        self.cut = cut


class CutInOut(nn.Module):
    """``x @ W + b`` over a weight stored (in, out), as transformers' ``Conv1D`` holds it."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, cut: Cut) -> None:
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)
        self.cut = cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight)
        return y if self.bias is None else y + self.bias


class CutEmbedding(nn.Embedding):
    """A lookup of the rows of the model's own table, as ``nn.Embedding`` makes it (torch's
    ``RowwiseParallel`` cuts its rows over the ranks)."""

    def __init__(self, weight: nn.Parameter, padding_idx: int | None, cut: Cut) -> None:
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = int(weight.shape[0]), int(weight.shape[1])
        self.padding_idx = padding_idx
        self.max_norm = None
        self.norm_type = 2.0
        self.scale_grad_by_freq = False
        self.sparse = False
        self.weight = weight
        self.cut = cut


CutModule = CutLinear | CutInOut | CutEmbedding


def cut_of(module: nn.Module) -> Cut | None:
    """The plan's cut a generated module carries; None for any other module."""
    if isinstance(module, (CutLinear, CutInOut, CutEmbedding)):
        return module.cut
    return None


class SequenceEntry(nn.Module):
    """Where a whole value (a position table, a norm's weight, a value from another stage)
    meets values cut along the sequence: it enters as a DTensor replicated over the tp mesh
    (torch slices it where it meets a cut value, without communicating; its gradient is
    summed over the ranks). Anything not a tensor passes as it is."""

    def __init__(self) -> None:
        super().__init__()
        #: The tp mesh, set when the program is cut over it.
        self.mesh: DeviceMesh | None = None

    def forward(self, x: object) -> object:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        if self.mesh is None:
            raise ConfigError(
                "a local program with values cut along the sequence runs on the tp ranks: "
                "cut it over the tp mesh first (parallelize_program), or plan with "
                "sequence_parallel=False to run it without one"
            )
        return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)


class ReplicatedRead(nn.Module):
    """Where a whole value that carries a gradient (a per-head norm's weight, a scale) is read
    by computations on values cut over the tp ranks: the value itself going forward, but read
    as a DTensor replicated over the tp mesh whose gradient comes back partial (each rank's
    from its own pieces), which torch's DTensor all-reduces, as its own styles do for a
    replicated input (:mod:`fxpipe.passes.tensor.partial`). A value that needs no gradient
    passes as it is."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.tp = tp
        #: The tp mesh, set when the program is cut over it.
        self.mesh: DeviceMesh | None = None

    def forward(self, x: object) -> object:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or self.tp == 1:
            return x
        if not x.requires_grad:
            return x
        if self.mesh is None:
            raise ConfigError(
                "a local program whose cut values read a whole value with a gradient runs on "
                "the tp ranks, which sum that gradient: cut it over the tp mesh first "
                "(parallelize_program)"
            )
        shared = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        return shared.to_local(grad_placements=[Partial()])


def gathered(x: object) -> object:
    """A value cut along the sequence, all-gathered for the readers outside its region: a
    DTensor replicated over the tp mesh, which column-wise products read as it is (their
    gradients, partial sums, are reduce-scattered back along the sequence); anything else
    passes as it is."""
    if isinstance(x, DTensor):
        return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
    return x


def local(x: object) -> object:
    """A gathered value as a plain tensor, for a reader that is not a product."""
    return x.to_local() if isinstance(x, DTensor) else x
