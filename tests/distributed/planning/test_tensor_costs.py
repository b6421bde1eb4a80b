"""fxpipe.distributed.planning.tensor_costs and suggest_layout's ``tensor_parallel``: a rank's
costs under the model's own tensor-parallel plan, written out again from the plan here, the
(pp, dp, tp) layouts ranked with them, and the same costs in seconds, by which
``pipeline_schedule`` balances the stages it cuts."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from models import TinyGPT
from torch import nn

import fxpipe.distributed as fd
from fxpipe.compiler import Compiled, compile_model
from fxpipe.distributed.planning import estimate as layout_estimate
from fxpipe.distributed.planning import priced as layout_priced
from fxpipe.distributed.planning.layout import DEFAULT_DEVICE_FLOPS, format_layouts
from fxpipe.distributed.planning.tensor_costs import DEFAULT_TP_BANDWIDTH, tensor_costs
from fxpipe.distributed.planning.tensor_parallel import rank_costs
from fxpipe.errors import ConfigError
from fxpipe.options import PlanOptions

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, BATCH, LENGTH, BANDWIDTH = 128, 8, 16, 1e9


def _toy(heads: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, width=16 * heads, heads=heads, layers=2, p=0.0)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))


@cache
def _priced(heads: int = 4) -> layout_priced.Priced:
    return layout_priced.priced_model(
        _toy(heads), (_ids(),), None, "flops", "auto", torch.device("cuda"), 1.0
    )


@pytest.mark.parametrize("sequence", [False, "auto"])
def test_a_ranks_costs_are_cut_where_the_plan_cuts(sequence: Any) -> None:
    """Every cut node costs 1 / tp, plus its collectives (ring all-reduce of a row-wise
    output forward and back, of a vocabulary lookup forward; the head's logits gathered and
    its input's gradient all-reduced) over the bandwidth; a cut Parameter is held 1 / tp.
    Under sequence parallelism the norms and adds between are cut too, a row-wise output is
    reduce-scattered forward and all-gathered back (half the ring), and each value gathered
    from a region is all-gathered forward and reduce-scattered back."""
    priced, tp = _priced(), 2
    gm = priced.traced.graph_module
    costs, plan = tensor_costs(gm, priced.traced.example_values, priced.costs, tp,
                               bandwidth=BANDWIDTH, seconds=1e-12,
                               sequence_parallel=sequence)  # fmt: skip
    assert plan.groups and set(plan.node_styles.values()) >= {"colwise", "rowwise"}
    assert bool(plan.sequence) == (sequence == "auto")  # the toy's regions hold norms
    ring = 2 * (tp - 1) / tp
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, before in priced.costs.nodes.items():
        after = costs.nodes[name]
        cut = name in plan.layouts or name in plan.node_styles or name in plan.sequence
        share = before.cost / tp if cut else before.cost
        style = plan.node_styles.get(name)
        moved = ring * before.output_bytes if name in plan.sequence_gathers else 0.0
        if style == "rowwise":
            moved += (1 if name in plan.sequence else 2) * ring * before.output_bytes
        elif style == "vocab":
            moved += ring * before.output_bytes
        elif style == "gathered":
            hidden = priced.costs.nodes[nodes[name].all_input_nodes[0].name].output_bytes
            moved = (tp - 1) / tp * before.output_bytes + ring * hidden
        assert after.cost == pytest.approx(share + moved / BANDWIDTH / 1e-12), name
        assert after.saved_bytes == (before.saved_bytes // tp if cut else before.saved_bytes)
    whole = dict(gm.named_parameters())
    cut_bytes = sum(
        whole[p.name].numel() * whole[p.name].element_size() // (tp if p.shard else 1)
        for p in plan.params.values()
    )
    assert sum(c.param_bytes for c in costs.nodes.values()) == cut_bytes
    assert cut_bytes < sum(c.param_bytes for c in priced.costs.nodes.values())


def test_layouts_span_pp_dp_tp_and_a_tp_rank_holds_and_computes_less() -> None:
    model, ids = _toy(), _ids()
    layouts = fd.suggest_layout(model, (ids,), 4, tensor_parallel=(1, 2, 4),
                                schedules=["gpipe"], chunks=[2])  # fmt: skip
    shapes = {(e.pp, e.dp, e.tp) for e in layouts}
    for e in layouts:  # what pipeline_schedule is given: tensor_parallel='auto' where tp > 1
        assert e.options.tensor_parallel == ("auto" if e.tp > 1 else None)
    zb = fd.suggest_layout(model, (ids,), 4, tensor_parallel=(1, 2), schedules=["zbvzerobubble"])
    assert {e.tp for e in zb} == {1, 2}  # a split backward runs under tensor parallelism
    assert {e.tp for e in layouts} == {1, 2, 4}
    assert all(pp * dp * tp == 4 for pp, dp, tp in shapes)
    header, _, *lines = format_layouts(layouts).splitlines()
    assert header.split()[:3] == ["pp", "dp", "tp"]
    assert [line.split()[2] for line in lines] == [str(e.tp) for e in layouts]
    one, two = (
        fd.suggest_layout(
            model,
            (ids,),
            tp,
            tensor_parallel=tp,
            schedules=["gpipe"],
            chunks=[2],
            runtime_costs=layout_estimate.NO_RUNTIME_COSTS,
            tp_bandwidth=1e18,  # the compute alone: no fixed costs, no waits
        )[0]
        for tp in (1, 2)
    )
    assert (one.pp, one.dp, one.tp) == (1, 1, 1) and (two.pp, two.dp, two.tp) == (1, 1, 2)
    assert two.memory_bytes < one.memory_bytes
    # the cut half, plus what stays whole (norms, embeddings' positions) and the collectives
    assert one.compute_s / 2 < two.compute_s < one.compute_s


def test_an_odd_head_count_leaves_attention_whole() -> None:
    """Three heads over tp = 2: the planner leaves each attention whole (said in its plan),
    so a rank computes more than half, and still holds less (the MLPs and the vocabulary
    are cut)."""
    priced = _priced(heads=3)
    gm = priced.traced.graph_module
    costs, plan = tensor_costs(gm, priced.traced.example_values, priced.costs, 2,
                               bandwidth=BANDWIDTH, seconds=1.0)  # fmt: skip
    assert {g.kind for g in plan.groups} >= {"mlp"} and "attention" not in {
        g.kind for g in plan.groups
    }
    assert plan.replicated  # the reasons are kept
    total = sum(c.cost for c in priced.costs.nodes.values())
    assert total / 2 < sum(c.cost for c in costs.nodes.values()) < total


def test_tensor_parallel_sizes_must_divide_the_world() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel=3.*divide world_size=8"):
        fd.suggest_layout(_toy(), (_ids(),), 8, tensor_parallel=3)
    with pytest.raises(ConfigError, match="tensor_parallel"):
        fd.suggest_layout(_toy(), (_ids(),), 8, tensor_parallel=0)


def _compiled(cost: str) -> Compiled:
    return compile_model(_toy(), (_ids(),), [torch.device("cpu")] * 2, PlanOptions(cost=cost))


def test_the_stages_are_balanced_by_one_tp_ranks_costs_in_seconds() -> None:
    """``rank_costs``, what ``pipeline_schedule`` partitions by under tensor parallelism:
    the layout model's per-rank table in seconds, the same from FLOP and from seconds."""
    for cost, seconds in (("auto", 1.0), ("flops", 1 / DEFAULT_DEVICE_FLOPS)):
        compiled = _compiled(cost)
        costs = compiled.plan.costs
        per_rank, _ = rank_costs(compiled, 2)
        assert per_rank is not None
        want, plan = tensor_costs(
            compiled.plan.graph_module, compiled.traced.example_values, costs, 2,
            bandwidth=DEFAULT_TP_BANDWIDTH, seconds=seconds,
        )  # fmt: skip
        for node in compiled.plan.graph_module.graph.nodes:
            got = per_rank(node)
            assert got == pytest.approx(want.nodes[node.name].cost * seconds, rel=1e-12)
            if plan.node_styles.get(node.name) == "colwise":  # half the work, no collective
                assert got == pytest.approx(costs.nodes[node.name].cost * seconds / 2)
    assert rank_costs(_compiled("params"), 2)[0] is None  # bytes are not a time: left as is


def test_a_stage_input_named_after_a_cut_product_is_not_cut_in_that_stage() -> None:
    """A stage's inputs are named after the values other stages computed; a row-wise
    product's output sent on is whole, and the next stage's plan must not take the
    product's style for its input (a partition by one rank's costs put one on a border)."""
    from fxpipe.distributed.planning.tensor_parallel import stage_plan
    from fxpipe.passes.tensor.plan import tensor_plan

    compiled = _compiled("auto")
    plan = tensor_plan(compiled.plan.graph_module, 2, compiled.traced.example_values)
    row = next(n for n, s in plan.node_styles.items() if s == "rowwise")
    graph = torch.fx.Graph()
    graph.output(graph.placeholder(row))
    assert stage_plan(plan, torch.fx.GraphModule(nn.Module(), graph)).node_styles == {}
