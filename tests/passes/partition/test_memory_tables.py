"""The memory tables the searches read (per split, per segment of an order, per pair of
ideals) against the memory of the plan made from the same split."""

from __future__ import annotations

from typing import Any

import networkx as nx
import numpy as np
import pytest
import torch
from models import ZOO

from fxpipe.passes.partition.cost_graph import to_networkx
from fxpipe.passes.partition.ideals import enumerate_ideals
from fxpipe.passes.partition.memory import MemoryModel, memory_model
from fxpipe.passes.partition.memory_tables import unit_memory
from fxpipe.passes.partition.orders import candidate_orders
from fxpipe.passes.partition.search import Partition, _values
from fxpipe.passes.partition.units import build_units
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.passes.split.plan import build_plan
from fxpipe.trace.tracing import trace

pytestmark = pytest.mark.usefixtures("one_thread")


def _zoo_graph(name: str, traffic: str) -> tuple[Any, Any, nx.DiGraph]:
    case = ZOO[name]
    args, kwargs = case.example(case.batch)
    t = trace(case.build().train(), args, kwargs, tracer=case.tracer)
    costs = estimate_costs(t.graph_module, t.example_values, mode="flops")
    return t, costs, to_networkx(t.graph_module, costs)


@pytest.mark.parametrize("traffic", ["direct", "relay"])
@pytest.mark.parametrize("name", ["transformer", "shared_module", "unet", "mlp_residual"])
def test_the_search_prices_memory_as_the_plan_does(name: str, traffic: str) -> None:
    """Tied weights, a module called twice, long skips: per split, per ideal pair and per
    segment of an order, the search's memory is the plan's (training and inference)."""
    t, costs, g = _zoo_graph(name, traffic)
    units = build_units(g)
    rng = np.random.default_rng(0)
    for k, chunks, checkpoint, training in (
        (2, 4, "except_last", True),
        (3, 3, "always", True),
        (4, 2, "never", True),
        (3, 4, "except_last", False),
    ):
        devices = [torch.device("cuda", j) for j in range(k)]
        model = memory_model(
            t.graph_module, costs, devices, [1] * k, chunks=chunks, checkpoint=checkpoint,
            training=training,
        )  # fmt: skip
        assert model is not None
        priced = unit_memory(model, g, units.unit_of, units.num_units, _values(g, units, traffic))
        order = candidate_orders(units)["depth"]
        for _ in range(4):  # random splits of one order
            borders = sorted(rng.choice(np.arange(1, units.num_units), k - 1, replace=False))
            unit_stage = np.searchsorted(borders, np.arange(units.num_units), side="right")
            unit_stage = unit_stage[np.argsort(order)]  # position -> unit
            stage_of = {n: int(unit_stage[u]) for n, u in units.unit_of.items()}
            for n, op in g.nodes(data="op"):
                if op == "placeholder":
                    stage_of[n] = 0
                elif op == "output":
                    stage_of[n] = k - 1
            for n, op in g.nodes(data="op"):
                if op == "get_attr":
                    stage_of[n] = min((stage_of[v] for v in g.successors(n)), default=0)
            split = Partition(stage_of, 0.0, "test", 0.0, traffic)  # type: ignore[arg-type]
            plan = build_plan(
                t.graph_module, costs, g, split, devices, chunks=chunks, checkpoint=checkpoint,
                training=training,
            )  # fmt: skip
            want = np.array([s.memory_bytes for s in plan.stages], dtype=np.float64)
            assert np.abs(priced.stage_bytes(unit_stage) - want).max() <= 1.0
            # the same split read off the order sweep, stage by stage
            swept = priced.on_order(order)
            swept.reset()
            edges = [0, *[int(b) for b in borders], units.num_units]
            got = []
            for t_end in range(1, units.num_units + 1):
                swept.advance(t_end)
                if t_end in edges[1:]:
                    j = edges.index(t_end) - 1
                    got.append(float(swept.stage(edges[j], j, edges[j] + 1)[0]))
            assert np.abs(np.array(got) - want).max() <= 1.0
        ideals = enumerate_ideals(units.dag, 3000)
        if ideals is not None:  # stages I - J of the lattice, against the split J | I - J | V - I
            table = priced.on_ideals(ideals)
            entering = _values(g, units, traffic)
            for _ in range(10):
                i = int(rng.integers(1, len(ideals)))
                below = [r for r in range(i) if (ideals[r] <= ideals[i]).all()]
                j_row = int(rng.choice(below))
                parts = [ideals[j_row], ideals[i] & ~ideals[j_row], ~ideals[i]]
                kept = [p for p in parts if p.any()]
                unit_stage = np.zeros(units.num_units, dtype=np.int64)
                for stage, members in enumerate(kept):
                    unit_stage[members] = stage
                m = len(kept)
                split_model = MemoryModel(
                    (1,) * m, tuple(map(str, range(m))), chunks, checkpoint, 1, model.saved,
                    model.params, training,
                )  # fmt: skip
                split = unit_memory(split_model, g, units.unit_of, units.num_units, entering)
                position = 1 if parts[0].any() else 0
                expect = split.stage_bytes(unit_stage)[position]
                assert table.stage(position if position < m - 1 else k - 1)[
                    i, j_row
                ] == pytest.approx(expect, rel=1e-9, abs=1.0)
