"""Sequence parallelism as the planner finds it: on Llama every norm, residual add and cast
between a row-wise product and the next column-wise ones is held cut along the sequence,
the row-wise products and the embedding reduce-scatter, and each norm's output is gathered
once for the products that read it; GPT-2's Conv1D products, which read the tokens
flattened, read them unflattened to do the same; a whole attention declines it under
``"auto"`` with the reason, and is cut under True;
a region stays in its stage; the local program runs the regions as DTensors (entries,
gathers, a norm module as its function). The numbers (equal to eager) are in
``test_parallelize.py`` and ``tests/distributed/planning/test_tensor_parallel.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch.fx as fx

from fxpipe.distributed.options import ScheduleOptions
from fxpipe.errors import ConfigError
from fxpipe.passes.ops import op_name
from fxpipe.passes.tensor.cut_modules import SequenceEntry, cut_of, gathered
from fxpipe.passes.tensor.local import local_program
from fxpipe.passes.tensor.plan import tensor_plan
from fxpipe.passes.tensor.records import TensorPlan
from fxpipe.passes.tensor.sequence import NORM_MODULES
from fxpipe.passes.tensor.styles import style_of
from tests.passes.tensor.test_plan import planned

pytestmark = pytest.mark.usefixtures("one_thread")


def _plan(name: str, choice: Any, stages: int = 1) -> tuple[fx.GraphModule, TensorPlan]:
    p = planned(name, 2, stages)
    return p.gm, tensor_plan(
        p.gm, 2, p.example, stage_of=p.plan.stage_of or None, sequence_parallel=choice
    )


def _nodes(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def test_llamas_norms_adds_and_casts_between_products_are_cut_along_the_sequence() -> None:
    gm, plan = _plan("llama", "auto")
    nodes = _nodes(gm)
    ops = {op_name(nodes[n]) for n in plan.sequence}
    assert {"embedding", "linear", "add", "mul", "pow", "mean", "rsqrt", "to"} >= ops >= {
        "add", "mul", "pow", "mean", "rsqrt"
    }  # fmt: skip
    assert set(plan.sequence.values()) == {1}
    # every row-wise product and the embedding reduce-scatter into a region
    scattered = {n for n, s in plan.node_styles.items() if s in ("rowwise", "vocab")}
    assert scattered <= set(plan.sequence)
    assert len(scattered) == 2 * 2 + 1
    # each norm's output gathered once for the products it feeds; the last one for the head
    readers = {tuple(sorted(r)) for r in plan.sequence_gathers.values()}
    assert len(plan.sequence_gathers) == 2 * 2 + 1
    assert sum(len(r) == 3 for r in readers) == 2  # q, k and v read one gather
    assert sum(len(r) == 2 for r in readers) == 2  # gate and up read one gather
    for value in plan.sequence_gathers:
        assert op_name(nodes[value]) == "mul"  # the norm's weight times its output
    norms = [k for k in plan.params if "norm" in k]
    assert norms and all("sequence parallel" in plan.params[k].reason for k in norms)
    text = plan.summary()
    assert "rowwise o_proj + reduce-scatter" in text
    assert "lookups reduce-scattered along the sequence" in text
    flat = " ".join(text.split())  # the line wraps
    assert "5 reduce-scatters" in flat and "5 all-gathers" in flat


def test_sequence_parallel_false_cuts_nothing_along_the_sequence_and_says_so() -> None:
    _, plan = _plan("llama", False)
    assert not plan.sequence and not plan.sequence_gathers
    text = plan.summary()
    assert "rowwise o_proj + all-reduce" in text
    assert "sequence   not cut: sequence_parallel=False" in text


def test_gpt2s_conv1d_products_read_the_tokens_unflattened_to_start_and_end_regions() -> None:
    """GPT-2's Conv1D products read the tokens flattened, (batch x sequence, features), and
    view their output back: the row-wise ones reduce-scatter as if they read them
    unflattened, and each region value a column-wise one reads is gathered once for it."""
    gm, plan = _plan("gpt2", "auto")
    nodes = _nodes(gm)
    rows = [n for n, s in plan.node_styles.items() if s == "rowwise"]
    columns = [n for n, s in plan.node_styles.items() if s == "colwise"]
    assert len(rows) == len(columns) == 2 * 2
    assert all(op_name(nodes[n]) == "addmm" for n in rows + columns)
    assert set(rows) <= set(plan.sequence)
    assert set(plan.unflattened) == set(rows + columns)  # each skips its flattening view
    for product, source in plan.unflattened.items():
        flat = nodes[product].args[1]  # addmm(bias, x.view(-1, nx), weight)
        assert isinstance(flat, fx.Node) and flat.args[0] is nodes[source]
    assert len(plan.sequence_gathers) == 2 * 2 + 1  # ln_1, ln_2 of each block and ln_f
    assert "rowwise c_proj + reduce-scatter" in plan.summary()


@pytest.mark.parametrize("name", ["odd_heads"])
def test_a_region_that_would_gather_more_than_it_scatters_is_declined_unless_asked(
    name: str,
) -> None:
    """A whole attention (a head count tp does not divide) reads its norm's output whole: a
    region there gathers more values than it reduce-scatters, so ``"auto"`` declines it,
    with the counts; True cuts it."""
    _, plan = _plan(name, "auto")
    assert not plan.sequence
    assert any("would all-gather" in why for why in plan.sequence_declined)
    assert "not cut: the region from" in " ".join(plan.summary().split())
    _, forced = _plan(name, True)
    assert forced.sequence and len(forced.sequence_gathers) > 1


def test_a_region_stays_in_its_stage_and_each_stage_gathers_what_it_sends() -> None:
    gm, plan = _plan("llama", "auto", stages=3)
    assert plan.sequence and len(set(plan.stage_of.values())) == 3
    nodes = _nodes(gm)
    for name in plan.sequence:
        for a in nodes[name].all_input_nodes:
            if a.name in plan.sequence and name not in plan.node_styles:
                assert plan.stage_of[a.name] == plan.stage_of[name], (a.name, name)
    crossing = [
        v
        for v, readers in plan.sequence_gathers.items()
        if any(plan.stage_of.get(r) != plan.stage_of[v] for r in readers)
    ]
    assert crossing  # the residual stream sent on is gathered in the stage that sends it


def test_the_local_program_runs_a_region_as_dtensors() -> None:
    """Whole values enter through one SequenceEntry, each gathered value is one
    ``gathered`` call that the column-wise products read, a row-wise product's style
    reduce-scatters along the sequence; a norm module becomes its function."""
    for name in ("llama", "toy"):
        gm, plan = _plan(name, "auto")
        local = local_program(gm, plan)
        entries = [m for m in local.modules() if isinstance(m, SequenceEntry)]
        assert len(entries) == 1
        calls = [n for n in local.graph.nodes if n.target is gathered]
        assert len(calls) == len(plan.sequence_gathers)
        for n in local.graph.nodes:
            if n.op != "call_module":
                continue
            module = local.get_submodule(str(n.target))
            cut = cut_of(module)
            if cut is None:
                continue
            style = style_of(module)
            if cut.style in ("rowwise", "vocab"):
                assert repr(style.output_layouts) == "(Shard(dim=1),)", n.name  # type: ignore[attr-defined]
                assert style.use_local_output is False  # type: ignore[attr-defined]
            elif n.args[0].target is gathered:  # type: ignore[union-attr]
                assert n.args[0].args[0].name in plan.sequence  # type: ignore[union-attr]
        # no call of a norm module is left in a region: each runs as its function
        for n in local.graph.nodes:
            if n.name in plan.sequence and n.op == "call_module":
                module = local.get_submodule(str(n.target))
                assert not isinstance(module, NORM_MODULES), n.name
        assert local.graph.find_nodes(op="call_module", target="_sequence_entry")


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_sequence_choice_not_known_is_refused_naming_it(value: Any) -> None:
    p = planned("llama")
    with pytest.raises(ConfigError, match=f"sequence_parallel={value!r} is not one of"):
        tensor_plan(p.gm, 2, p.example, sequence_parallel=value)
    with pytest.raises(ConfigError, match=f"sequence_parallel={value!r} is not one of"):
        ScheduleOptions(n_microbatches=2, tensor_parallel="auto", sequence_parallel=value)


def test_sequence_parallel_true_needs_fxpipes_own_plan() -> None:
    with pytest.raises(ConfigError, match="sequence_parallel=True with tensor_parallel=None"):
        ScheduleOptions(n_microbatches=2, sequence_parallel=True)


def test_a_local_program_with_sequence_cut_values_run_without_its_mesh_is_refused() -> None:
    """Its whole values cannot enter a region as DTensors without the tp mesh: said, with
    the remedies, not run on plain tensors as if nothing were cut."""
    p = planned("llama")
    local = local_program(p.gm, p.plan)
    with pytest.raises(ConfigError, match=r"cut it over the tp mesh first \(parallelize_program"):
        local(*p.example)
