"""Property test: on random non-Sequential models the plan is valid and the pipeline equals eager.

Models come from ``random_models.specs`` (branches, skips of any length, add / product /
concat joins, values with several readers, in-place writes, p=0 dropout, tuple or dict
outputs). For each, random stage count, chunks, batch size, checkpoint mode and cost mode;
the model runs in float64, so outputs and every parameter gradient must match eager to
1e-9 relative error.

The regular run is derandomized (the same examples every time). A longer or different run:
``FXPIPE_FUZZ_EXAMPLES=5000`` sets the example count and ``FXPIPE_FUZZ_SEED=123`` draws
another sequence; on failure Hypothesis prints the shrunk example and a reproduction blob.
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from oracle import relative_error
from random_models import WIDTH, Op, RandomNet, Spec, specs
from torch import nn
from torch.utils._pytree import tree_flatten

from fxpipe.api import pipeline_of
from fxpipe.compiler import compile_model
from fxpipe.errors import PlanError
from fxpipe.ir import PipelinePlan
from fxpipe.options import PlanOptions, RunOptions
from fxpipe.pipeline import Pipeline

EXAMPLES = int(os.environ.get("FXPIPE_FUZZ_EXAMPLES", "150"))
SEED = os.environ.get("FXPIPE_FUZZ_SEED")
TOLERANCE = 1e-9
MODES = ("always", "except_last", "never")

SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=SEED is None,
    database=None,
    print_blob=True,
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _seeded(test: Any) -> Any:
    return seed(int(SEED))(test) if SEED is not None else test


def _loss(out: Any) -> torch.Tensor:
    """Reaches every output with fixed, distinct per-element weights."""
    total = torch.zeros((), dtype=torch.float64)
    for t in tree_flatten(out)[0]:
        weights = torch.linspace(-1.0, 1.0, t.numel(), dtype=t.dtype).reshape(t.shape)
        total = total + (t * weights).sum()
    return total


def check_plan(plan: PipelinePlan, stages: int) -> None:
    """Every node placed, placeholders in stage 0, every edge going forward."""
    graph = plan.graph_module.graph
    assert plan.num_stages == stages
    assert set(plan.stage_of) == {n.name for n in graph.nodes}
    assert all(0 <= j < stages for j in plan.stage_of.values())
    for node in graph.nodes:
        if node.op == "placeholder":
            assert plan.stage_of[node.name] == 0, node.name
        for user in node.users:
            assert plan.stage_of[user.name] >= plan.stage_of[node.name], (node.name, user.name)
    for edge in plan.edges:
        assert all(c > edge.producer for c in edge.consumers), edge


def _compile(model: nn.Module, x: torch.Tensor, stages: int, cost: str) -> Any:
    """Compile over ``stages`` CPU stages, or as many as the graph allows."""
    try:
        return compile_model(
            model, x, ["cpu"] * stages, PlanOptions(cost=cost, tracer="fx")
        ), stages
    except PlanError as e:
        found = re.search(r"at most (\d+) stages?", str(e))
        assert found is not None and 1 <= int(found.group(1)) < stages, str(e)
        fewer = int(found.group(1))
        return compile_model(model, x, ["cpu"] * fewer, PlanOptions(cost=cost, tracer="fx")), fewer


def run_case(
    spec: Spec,
    batch: int,
    stages: int,
    chunks: int,
    checkpoint: str,
    cost: str,
    init: int,
    input_grad: bool = False,
) -> None:
    torch.manual_seed(init)
    model = RandomNet(spec).double()
    twin = copy.deepcopy(model)
    x = torch.randn(batch, WIDTH, dtype=torch.float64)
    xs = [x.clone().requires_grad_(input_grad) for _ in range(2)]
    compiled, stages = _compile(model, x, stages, cost)
    check_plan(compiled.plan, stages)
    pipe = pipeline_of(model, compiled, RunOptions(chunks=chunks, checkpoint=checkpoint))
    got, want = pipe(xs[0]), twin(xs[1])
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    assert got_spec == want_spec
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert g.shape == w.shape and g.requires_grad >= w.requires_grad
        assert relative_error(g.detach(), w.detach()) < TOLERANCE
    if not _loss(want).requires_grad:
        return
    _loss(got).backward()
    _loss(want).backward()
    if input_grad:
        assert xs[0].grad is not None and xs[1].grad is not None
        assert relative_error(xs[0].grad, xs[1].grad) < TOLERANCE
    named = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        ref = named[name].grad
        if ref is None:
            assert p.grad is None, f"{name} got a gradient eager has not"
        else:
            assert p.grad is not None, f"{name} got no gradient"
            assert relative_error(p.grad, ref) < TOLERANCE, name


@pytest.mark.slow
@_seeded
@SETTINGS
@given(
    spec=specs(),
    batch=st.sampled_from((1, 2, 3, 4, 5, 6, 7, 8)),
    stages=st.sampled_from((1, 2, 3, 4)),
    chunks=st.sampled_from((1, 2, 3, 4, 5, 6, 7, 8)),
    checkpoint=st.sampled_from(MODES),
    cost=st.sampled_from(("flops", "params")),
    init=st.integers(0, 2**16),
    input_grad=st.booleans(),
)
def test_random_models_split_validly_and_equal_eager(
    spec: Spec,
    batch: int,
    stages: int,
    chunks: int,
    checkpoint: str,
    cost: str,
    init: int,
    input_grad: bool,
) -> None:
    run_case(spec, batch, stages, chunks, checkpoint, cost, init, input_grad)


@pytest.mark.parametrize("checkpoint", MODES)
def test_a_write_between_two_readers_in_other_stages(checkpoint: str) -> None:
    """A fixed case of what the strategy draws: a value read before and after an in-place
    write, with each reader free to land in another stage."""
    spec = Spec(
        ops=(
            _op("linear", 0),
            _op("fresh", 1),
            _op("scale", 2),  # reads the old value
            _op("linear", 3),
            _op("write", 2, variant="add_"),
            _op("linear", 4),
            _op("add", 6, 2),  # reads the written value
            _op("cat", 7, 5),
        ),
        outputs=(8, 5),
        output_kind="dict",
    )
    for stages in (2, 3, 4):
        run_case(spec, 8, stages, 4, checkpoint, "flops", 0)


def _op(kind: str, *inputs: int, variant: str = "") -> Op:
    return Op(kind, inputs, variant)


class DeadBranch(nn.Module):
    """Two chains side by side; only ``live`` reaches the output, ``dead`` crosses stages."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.b = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dead, live = x, x
        for a, b in zip(self.a, self.b, strict=True):
            dead, live = torch.tanh(a(dead)), torch.tanh(b(live))
        return live


def _dead_branch_pipe(checkpoint: str) -> tuple[Pipeline, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model, x = DeadBranch(), torch.randn(8, 4)
    compiled = compile_model(model, x, ["cpu"] * 3, PlanOptions(cost="flops", tracer="fx"))
    pipe = pipeline_of(model, compiled, RunOptions(chunks=2, checkpoint=checkpoint))
    return pipe, model, x


def _dead_values(plan: PipelinePlan) -> set[str]:
    """Nodes the output does not depend on."""
    graph = plan.graph_module.graph
    live: set[str] = set()
    todo = [n for n in graph.nodes if n.op == "output"]
    while todo:
        node = todo.pop()
        if node.name not in live:
            live.add(node.name)
            todo.extend(node.all_input_nodes)
    return {n.name for n in graph.nodes} - live


@pytest.mark.parametrize("checkpoint", MODES)
def test_a_dead_branch_crossing_a_border_gets_no_nonzero_gradient(checkpoint: str) -> None:
    pipe, model, x = _dead_branch_pipe(checkpoint)
    assert {e.value for e in pipe.plan.edges} & _dead_values(pipe.plan)  # crosses a border
    twin = copy.deepcopy(model)
    torch.testing.assert_close(pipe(x), twin(x))
    pipe(x).sum().backward()
    twin(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("checkpoint", MODES)
def test_a_dead_branch_leaves_grad_none(checkpoint: str) -> None:
    pipe, model, x = _dead_branch_pipe(checkpoint)
    pipe(x).sum().backward()
    assert [n for n, p in model.a.named_parameters() if p.grad is not None] == []


def test_an_output_of_a_checkpointed_stage_no_loss_reaches_gets_no_gradient() -> None:
    """Stage 0 sends a dead branch's value on; its checkpointed backward must not turn the
    missing gradient into zeros (which would give the dead branch grad=0, not None)."""
    spec = Spec(
        ops=tuple(_op("linear", i) for i in (0, 0, 1, 2, 3, 4)),  # v1->v3->v5 is dead
        outputs=(6,),
        output_kind="tensor",
    )
    torch.manual_seed(0)
    model = RandomNet(spec).double()
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    compiled = compile_model(model, x, ["cpu"] * 3, PlanOptions(cost="flops", tracer="fx"))
    assert compiled.program.outputs[0] == ("layers_op0", "layers_op1")
    pipe = pipeline_of(model, compiled, RunOptions(chunks=1, checkpoint="always"))
    pipe(x).sum().backward()
    assert model.layers["op0"].weight.grad is None
    assert model.layers["op1"].weight.grad is not None
