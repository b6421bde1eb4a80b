"""Generates one GraphModule per stage from a plan, with explicit inputs and outputs.

Stage ``j``'s module takes the values it reads (in graph order) as positional arguments
and returns a tuple of the values later stages or the model output need. Modules and
parameters are the user's own objects, shared by reference, never copied.

Two ways to move values between stages:

- ``"direct"``: a value goes from its producer straight to every stage that reads it;
  model inputs go straight from the caller to every stage that reads them.
- ``"relay"``: every value passes through each stage between its producer and its last
  reader, and model inputs enter at stage 0; for engines that only connect neighbours.
  Model outputs then all leave from the last stage.

For example, a model whose stage 0 makes ``h0`` and ``h1`` and whose stage 2 reads
``h0`` gets, in direct mode, ``stage1(h1) -> (h2,)`` and ``stage2(h0, h2)``; in relay mode
``stage1(h0, h1) -> (h0, h2)``.

A ``get_attr`` of an object that is not a tensor (the body GraphModule of a higher-order
op such as ``wrap_with_autocast``) moves in neither mode: every stage that reads it gets
its own ``get_attr`` of the same object, and it is no stage's input or output.
"""

from __future__ import annotations

import torch.fx as fx

from fxpipe.ir import PipelinePlan, StageProgram, Traffic, ValueRef
from fxpipe.passes.partition.cost_graph import batched_nodes, replicated_attrs
from fxpipe.passes.split.placement import place_graph

__all__ = ["split_stages", "run_stages"]


def split_stages(
    plan: PipelinePlan, output_spec: object, *, traffic: Traffic = "direct"
) -> StageProgram:
    """Stage modules for ``plan`` (built on ``plan.graph_module``, which is not modified)."""
    gm = plan.graph_module
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    assert output.op == "output"
    placeholders = tuple(n.name for n in nodes if n.op == "placeholder")
    inputs, outputs, copies = _flow(plan, nodes, traffic)
    modules = tuple(
        _stage_module(gm, plan, j, inputs[j], outputs[j], copies) for j in range(plan.num_stages)
    )
    leaves = tuple(ValueRef(a.name) if isinstance(a, fx.Node) else a for a in output.args[0])
    batched = batched_nodes(gm)
    received = {name for names in inputs for name in names}
    return StageProgram(
        modules=modules,
        inputs=tuple(tuple(x) for x in inputs),
        outputs=tuple(tuple(x) for x in outputs),
        graph_inputs=placeholders,
        output_leaves=leaves,
        output_spec=output_spec,  # type: ignore[arg-type]
        traffic=traffic,
        whole=frozenset(received - batched),
    )


def _flow(
    plan: PipelinePlan, nodes: list[fx.Node], traffic: Traffic
) -> tuple[list[list[str]], list[list[str]], dict[str, set[int]]]:
    """Each stage's inputs and outputs, and the stages that name each non-tensor attribute
    themselves (:func:`_attr_copies`) rather than receive it."""
    shared = replicated_attrs(plan.graph_module)
    moved = [n for n in nodes if n.name not in shared]
    inputs, outputs = _direct(plan, moved) if traffic == "direct" else _relay(plan, moved)
    attrs = [n for n in nodes if n.name in shared]
    copies = _attr_copies(plan, attrs, traffic)
    for node in attrs:  # a model that returns the object: the stage named for it returns it
        if _to_output(node):
            last = plan.num_stages - 1
            outputs[last if traffic == "relay" else plan.stage_of[node.name]].append(node.name)
    return inputs, outputs, copies


def _attr_copies(
    plan: PipelinePlan, attrs: list[fx.Node], traffic: Traffic
) -> dict[str, set[int]]:
    """Stages that hold their own ``get_attr`` of each non-tensor attribute: every stage
    that reads it, its own stage, and in relay mode the last stage when the model returns
    it (direct mode: its own stage returns it)."""
    copies: dict[str, set[int]] = {}
    for node in attrs:
        stages = _readers(plan, node) | {plan.stage_of[node.name]}
        if traffic == "relay" and _to_output(node):
            stages.add(plan.num_stages - 1)
        copies[node.name] = stages
    return copies


def _readers(plan: PipelinePlan, node: fx.Node) -> set[int]:
    return {plan.stage_of[u.name] for u in node.users if u.op != "output"}


def _to_output(node: fx.Node) -> bool:
    return any(u.op == "output" for u in node.users)


def _direct(plan: PipelinePlan, nodes: list[fx.Node]) -> tuple[list[list[str]], list[list[str]]]:
    k = plan.num_stages
    inputs: list[list[str]] = [[] for _ in range(k)]
    outputs: list[list[str]] = [[] for _ in range(k)]
    for node in nodes:
        if node.op == "output":
            continue
        j = plan.stage_of[node.name]
        readers = _readers(plan, node)
        for r in sorted(readers):
            if r != j or node.op == "placeholder":
                inputs[r].append(node.name)
        if node.op == "placeholder":
            continue
        if readers - {j} or _to_output(node):
            outputs[j].append(node.name)
    return inputs, outputs


def _relay(plan: PipelinePlan, nodes: list[fx.Node]) -> tuple[list[list[str]], list[list[str]]]:
    k = plan.num_stages
    inputs: list[list[str]] = [[] for _ in range(k)]
    outputs: list[list[str]] = [[] for _ in range(k)]
    for node in nodes:
        if node.op == "output":
            continue
        readers = _readers(plan, node)
        if _to_output(node):
            readers.add(k - 1)
        if not readers:
            continue
        is_input = node.op == "placeholder"
        first = 0 if is_input else plan.stage_of[node.name]
        last = max(readers)
        for j in range(first if is_input else first + 1, last + 1):
            inputs[j].append(node.name)
        for j in range(first, last):
            outputs[j].append(node.name)
        if _to_output(node):
            outputs[k - 1].append(node.name)
    return inputs, outputs


def _stage_module(
    gm: fx.GraphModule,
    plan: PipelinePlan,
    j: int,
    inputs: list[str],
    outputs: list[str],
    copies: dict[str, set[int]],
) -> fx.GraphModule:
    """Stage ``j``'s GraphModule; the user's modules and tensors, and every non-tensor
    attribute it names (``copies``), are shared with ``gm`` by reference."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name in inputs:
        env[name] = graph.placeholder(name)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        mine = j in copies[node.name] if node.name in copies else plan.stage_of[node.name] == j
        if mine:
            env[node.name] = graph.node_copy(node, lambda n: env[n.name])
    graph.output(tuple(env[name] for name in outputs))
    place_graph(graph, plan.devices[j])
    graph.lint()
    return fx.GraphModule(gm, graph, f"Stage{j}")


def run_stages(program: StageProgram, values: tuple[object, ...]) -> list[object]:
    """Run every stage in order on one device: the reference composition of a program.

    Returns the flat model output, as ``plan.graph_module(*values)`` would.
    """
    env: dict[str, object] = dict(zip(program.graph_inputs, values))
    for module, names_in, names_out in zip(program.modules, program.inputs, program.outputs):
        result = module(*[env[n] for n in names_in])
        env.update(zip(names_out, result))
    return [env[x.name] if isinstance(x, ValueRef) else x for x in program.output_leaves]
