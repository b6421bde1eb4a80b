"""Recomputes values made only from model inputs and buffers where they are read.

Attention masks and rotary tables are built once from small inputs (a B x T padding
mask, position ids) and read by every layer, but they are large: a B x 1 x T x T mask
is T times its source. Sent between stages they would cross every border. Each reader
gets instead its own copy of the chain that makes the value, marked so that the units
pass keeps the copy with its reader: the stage recomputes it from the small input.

A value qualifies when every node of its chain is a pure call (no random op, no in-place
write) whose inputs are model inputs, buffers, constants or other such nodes; never a
parameter, so no gradient flows through the copies into weights. A reader gets a copy
only when the chain is shared (one of its nodes has several readers), is at most
``MAX_CHAIN`` nodes long, and its value is larger than the inputs and buffers
it is made from: recomputing never sends more than sending the value would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from operator import attrgetter

import torch.fx as fx
from torch import nn

from fxpipe.ir import RECOMPUTE
from fxpipe.passes.ops import mutated_input
from fxpipe.trace.private_chains import copy_per_reader

__all__ = ["recompute_input_values", "RECOMPUTE", "MAX_CHAIN"]

#: Longest chain copied per reader.
MAX_CHAIN = 32
_RANDOM = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson")


def recompute_input_values(
    gm: fx.GraphModule, output_bytes: Callable[[], Mapping[str, int] | None]
) -> int:
    """Give each reader of a shared input-derived value its own copy of the value's chain
    (rewriting ``gm`` in place); returns how many readers got one (0: the graph is
    unchanged). ``output_bytes()`` maps node names to the bytes of their values; it is
    called only when some chain qualifies otherwise, and None from it changes nothing."""
    graph = gm.graph
    derived = _input_derived(gm)
    if any(_writes(gm, n) and set(n.all_input_nodes) & derived for n in graph.nodes):
        return 0  # a copy placed after that write would read the written value
    frontier = {n for n in derived if any(u not in derived and u.op != "output" for u in n.users)}
    chains = {n: _chain(n, derived) for n in frontier}
    chains = {
        n: chain
        for n, chain in chains.items()
        if len(chain) <= MAX_CHAIN and any(len(c.users) > 1 for c in chain)
    }
    sizes = output_bytes() if chains else None
    if sizes is None:
        return 0
    copied = {
        n
        for n, chain in chains.items()
        if sizes.get(n.name, 0) > _source_bytes(chain, derived, sizes)
    }
    if not copied:
        return 0
    return copy_per_reader(gm, derived, copied, mark=RECOMPUTE)


def _input_derived(gm: fx.GraphModule) -> set[fx.Node]:
    """Calls computed only from model inputs, buffers, constants and other such calls
    (inputs and buffers something writes into in place do not count)."""
    sources: set[fx.Node] = set()
    derived: set[fx.Node] = set()
    for node in gm.graph.nodes:
        written = any(_writes(gm, u) for u in node.users)
        if node.op == "placeholder" and not written:
            sources.add(node)
        elif node.op == "get_attr" and not written:
            if not isinstance(attrgetter(str(node.target))(gm), nn.Parameter):
                sources.add(node)
        elif node.op in ("call_function", "call_method") and _pure(gm, node):
            if all(n in sources or n in derived for n in node.all_input_nodes):
                derived.add(node)  # a factory call with no input (ones, arange) too
    return derived


def _name(node: fx.Node) -> str:
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return str(name).split(".")[0]


def _writes(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` writes into one of its inputs (the rule the partitioner uses)."""
    return mutated_input(gm, node) is not None


def _pure(gm: fx.GraphModule, node: fx.Node) -> bool:
    """No write, no randomness, no check kept for its side effect."""
    name = _name(node)
    if _writes(gm, node) or name.startswith("_assert"):
        return False
    return not any(word in name for word in _RANDOM)


def _chain(value: fx.Node, derived: set[fx.Node]) -> set[fx.Node]:
    """The derived nodes ``value`` is computed from, itself included."""
    seen: set[fx.Node] = set()
    stack = [value]
    while stack:
        node = stack.pop()
        if node in seen or node not in derived:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _source_bytes(
    chain: set[fx.Node], derived: set[fx.Node], output_bytes: Mapping[str, int]
) -> int:
    """Bytes of the inputs and buffers ``chain`` reads."""
    sources = {s for n in chain for s in n.all_input_nodes if s not in derived}
    return sum(output_bytes.get(s.name, 0) for s in sources)
