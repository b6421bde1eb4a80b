"""Shape queries read by several nodes get one copy per reader, so sizes glue no stages."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from models import ZOO
from torch import nn

from fxpipe.passes.partition.cost_graph import to_networkx
from fxpipe.passes.partition.search import partition_graph
from fxpipe.passes.partition.units import build_units
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.trace.shapes import is_shape_query, replicate_shape_queries
from fxpipe.trace.tracing import trace

pytestmark = pytest.mark.usefixtures("one_thread")


class SharedLength(nn.Module):
    """Reads the sequence length once and reshapes with it in every layer (fx traces it)."""

    def __init__(self, width: int = 8, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        width = x.size(2) * 1
        for layer in self.layers:
            x = torch.relu(layer(x)).reshape(-1, length, width) + 1.0
        return x


def _units(name_or_model: str | nn.Module, tracer: str = "auto") -> tuple[object, object]:
    if isinstance(name_or_model, str):
        case = ZOO[name_or_model]
        model, (args, kwargs), tracer = case.build(), case.example(case.batch), case.tracer
    else:
        model, args, kwargs = name_or_model, (torch.randn(4, 5, 8),), {}
    t = trace(model.eval(), args, kwargs, tracer=tracer)
    g = to_networkx(t.graph_module, estimate_costs(t.graph_module, t.example_values, mode="flops"))
    return t, build_units(g)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_every_shape_query_has_one_reader_and_the_graph_still_equals_eager(tracer: str) -> None:
    model = SharedLength()
    t, units = _units(model, tracer)
    gm = t.graph_module  # type: ignore[attr-defined]
    queries = [n for n in gm.graph.nodes if is_shape_query(n)]
    assert all(len(n.users) == 1 for n in queries)
    assert queries or tracer == "export"  # export folds the static sizes into constants
    for batch in (4, 3):
        x = torch.randn(batch, 5, 8)
        torch.testing.assert_close(gm(x)[0], model(x), rtol=0, atol=0)
    # no unit spans two layers: each layer can get a stage of its own
    for members in units.members:  # type: ignore[attr-defined]
        assert sum(name.startswith("reshape") for name in members) <= 1, members


@pytest.mark.slow
def test_export_batch_size_no_longer_makes_one_unit_of_the_network() -> None:
    _, units = _units("llama")
    # torch.export reads the batch size once; before, every view shared it and 140 of
    # the graph's 221 nodes made one unit (now the largest is an attention kernel with the
    # mask it recomputes, fxpipe.trace.recompute)
    assert max(len(m) for m in units.members) <= 20  # type: ignore[attr-defined]
    assert units.num_units > 100  # type: ignore[attr-defined]


@pytest.mark.slow
def test_llama_splits_into_balanced_stages() -> None:
    t, _ = _units("llama")
    gm = t.graph_module  # type: ignore[attr-defined]
    g = to_networkx(gm, estimate_costs(gm, t.example_values, mode="flops"))  # type: ignore[attr-defined]
    total = sum(w for _, w in g.nodes(data="weight"))
    part = partition_graph(g, 4)
    assert part.bottleneck < 0.45 * total  # one unit held ~2/3 of the work before


def test_graph_without_shared_queries_is_left_alone() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    code = gm.code
    assert replicate_shape_queries(gm) == 0
    assert gm.code == code


def test_tensor_arithmetic_is_not_a_shape_query() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    size = graph.call_method("size", (x, 0))
    doubled = graph.call_function(operator.mul, (size, 2))
    added = graph.call_function(operator.add, (x, x))
    scaled = graph.call_function(operator.mul, (x, size))
    assert is_shape_query(size) and is_shape_query(doubled)
    assert not is_shape_query(added) and not is_shape_query(scaled) and not is_shape_query(x)
