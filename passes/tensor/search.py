"""The search for the column/row groups of a graph: every product taken column-wise, its cut
followed forward (:func:`fxpipe.passes.tensor.layouts.follow`) into groups, and the groups
that fail dropped (or their fused products tried in more parts) until a fixed point."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from fxpipe.passes.ops import op_name
from fxpipe.passes.tensor.cuts import ATTENTION_OPS, Blocked, Rules
from fxpipe.passes.tensor.given import GivenPlan
from fxpipe.passes.tensor.layouts import follow
from fxpipe.passes.tensor.products import Product
from fxpipe.passes.tensor.records import Layout, Shard
from fxpipe.passes.tensor.reshapes import feature_parts

__all__ = ["Flow", "Search"]


@dataclass
class Flow:
    """Where the cuts of the current column products reach: the layouts, the groups (a
    union-find over node names), each group's row-wise products and the first reason a
    group fails."""

    layouts: dict[str, Layout] = field(default_factory=dict)
    parent: dict[str, str] = field(default_factory=dict)
    rows: dict[str, dict[str, int]] = field(default_factory=dict)  # root -> row -> parts
    bad: dict[str, str] = field(default_factory=dict)
    #: root -> the node the group failed at (where an op blocked the cut).
    where: dict[str, str] = field(default_factory=dict)
    heads: dict[str, set[int]] = field(default_factory=dict)
    attention: set[str] = field(default_factory=set)

    def root(self, name: str) -> str:
        while self.parent[name] != name:
            self.parent[name] = self.parent[self.parent[name]]
            name = self.parent[name]
        return name

    def union(self, a: str, b: str) -> None:
        ra, rb = self.root(a), self.root(b)
        if ra == rb:
            return
        self.parent[rb] = ra
        self.rows.setdefault(ra, {}).update(self.rows.pop(rb, {}))
        self.heads.setdefault(ra, set()).update(self.heads.pop(rb, set()))
        if rb in self.bad:
            self.bad.setdefault(ra, self.bad.pop(rb))
        if rb in self.where:
            self.where.setdefault(ra, self.where.pop(rb))
        if rb in self.attention:
            self.attention.add(ra)

    def fail(self, name: str, reason: str, at: str | None = None) -> None:
        root = self.root(name)
        self.bad.setdefault(root, reason)
        if at is not None:
            self.where.setdefault(root, at)


class Search:
    """The column products and their groups, searched to a fixed point."""

    def __init__(
        self,
        gm: fx.GraphModule,
        rules: Rules,
        products: dict[str, Product],
        readers: dict[str, list[str]],
        stage_of: dict[str, int],
        given: GivenPlan | None = None,
    ) -> None:
        self.gm, self.rules, self.products, self.readers = gm, rules, products, readers
        self.stage_of = stage_of
        #: The user's plan, what it allows a weight and each product (None: fxpipe chooses).
        self.given = given
        self.allowed_of = given.on(gm) if given is not None else None
        self.allowed = {
            name: None if self.allowed_of is None else self.allowed_of(p.weight)
            for name, p in products.items()
        }
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.order = {name: k for k, name in enumerate(self.nodes)}
        #: Product -> why it is not cut column-wise; -> why the group it ends is dropped.
        self.reasons: dict[str, str] = {}
        self.ends: dict[str, str] = {}
        #: Product -> the node its column-wise cut last failed at.
        self.failed_at: dict[str, str] = {}
        self.parts: dict[str, list[int]] = {}
        self.choice: dict[str, int] = {}
        self.active: set[str] = set()
        for name, product in products.items():
            reason = self._refusal(product)
            if reason is not None:
                self.reasons[name] = reason
                continue
            self.active.add(name)
            self.parts[name] = feature_parts(self.nodes[name], rules)
            self.choice[name] = 0

    def _shared(self, p: Product) -> str | None:
        """Why product ``p`` cannot be cut either way: a parameter others read too."""
        for param in (p.weight, p.bias):
            others = [r for r in self.readers.get(param or "", []) if r != p.node]
            if param is not None and others:
                return f"its parameter {param} is also read by {', '.join(others)}"
        return None

    def _refusal(self, p: Product) -> str | None:
        """Why product ``p`` cannot be cut column-wise at all, or None."""
        shared = self._shared(p)
        if shared is not None:
            return shared
        allowed = self.allowed[p.node]
        if allowed is not None and "colwise" not in allowed:
            return "the given plan does not name it ColwiseParallel()"
        if p.out_features % self.rules.tp:
            return f"its {p.out_features} output features do not divide by tp={self.rules.tp}"
        return None

    def run(self) -> Flow:
        """Drop failing groups (or try their fused products in more parts) and resolve a
        product claimed both ways, until every group holds."""
        while True:
            flow = self._flow()
            groups = self.groups(flow)
            if self._drop_failures(flow, groups) or self._drop_clashes(flow, groups):
                continue
            return flow

    def groups(self, flow: Flow) -> dict[str, list[str]]:
        """Group root -> its column products (in graph order), for the current columns."""
        out: dict[str, list[str]] = {}
        for name in sorted(self.active, key=self.order.__getitem__):
            out.setdefault(flow.root(name), []).append(name)
        return out

    def _drop_failures(self, flow: Flow, groups: dict[str, list[str]]) -> bool:
        changed = False
        for root, columns in groups.items():
            reason = flow.bad.get(root)
            if reason is None:
                continue
            changed = True
            more = [c for c in columns if self.choice[c] + 1 < len(self.parts[c])]
            for c in more:
                self.choice[c] += 1
            if not more:
                for c in columns:
                    self.active.discard(c)
                    self.reasons[c] = reason
                    if root in flow.where:
                        self.failed_at[c] = flow.where[root]
                for r in flow.rows.get(root, {}):
                    self.ends[r] = f"the group it would end ({', '.join(columns)}) fails: {reason}"
        return changed

    def _drop_clashes(self, flow: Flow, groups: dict[str, list[str]]) -> bool:
        """A product both column-wise (in a group) and row-wise (ending another) stays
        row-wise for the earliest group; it leaves the later one."""
        rows: set[str] = set()
        changed = False
        for root in sorted(groups, key=lambda r: self.order[groups[r][0]]):
            mine = flow.rows.get(root, {})
            clash = [c for c in groups[root] if c in rows or c in mine]
            for c in clash:
                self.active.discard(c)
                self.reasons[c] = "it is the row-wise product of the group before it"
            changed |= bool(clash)
            if not clash:
                rows |= set(mine)
        return changed

    def _flow(self) -> Flow:
        flow = Flow()
        for n in self.gm.graph.nodes:
            cut = [a.name for a in n.all_input_nodes if a.name in flow.layouts]
            if cut:
                self._step(flow, n, cut)
            if n.name in self.active:
                size = self.rules.size(n)
                assert size is not None
                parts = self.parts[n.name][self.choice[n.name]]
                flow.layouts[n.name] = Shard(len(size) - 1, parts)
                flow.parent[n.name] = n.name
        self._check_borders(flow)
        return flow

    def _step(self, flow: Flow, n: fx.Node, cut: list[str]) -> None:
        """Follow the cut inputs ``cut`` through node ``n``."""
        product = self.products.get(n.name)
        if product is not None:
            layout = flow.layouts.get(product.x)
            size = self.rules.size(self.nodes[product.x])
            shared = self._shared(product)
            if shared is not None:
                for c in cut:
                    flow.fail(c, f"{n.name} would contract the cut, but {shared}", at=n.name)
                return
            allowed = self.allowed[n.name]
            if allowed is not None and "rowwise" not in allowed:
                for c in cut:
                    flow.fail(
                        c,
                        f"{n.name} contracts the cut, but the given plan does not name "
                        f"{product.weight.rpartition('.')[0]} RowwiseParallel()",
                        at=n.name,
                    )
                return
            if cut == [product.x] and isinstance(layout, Shard) and size is not None:
                if layout.dim == len(size) - 1:
                    flow.rows.setdefault(flow.root(product.x), {})[n.name] = layout.blocks
                    return
            for c in cut:
                flow.fail(c, f"{n.name} multiplies by its weight along another dimension")
            return
        result = follow(n, flow.layouts, self.rules)
        if isinstance(result, Blocked):
            for c in cut:
                flow.fail(c, result.reason, at=n.name)
            return
        if result is None:
            return
        heads = self._heads(flow, n, cut, result)
        flow.layouts[n.name] = result
        flow.parent[n.name] = n.name
        for c in cut:
            flow.union(c, n.name)
        root = flow.root(n.name)
        if op_name(n) in ATTENTION_OPS or op_name(n) in ("matmul", "bmm"):
            flow.attention.add(root)
        if heads is not None:
            flow.heads.setdefault(root, set()).add(heads)

    def _heads(self, flow: Flow, n: fx.Node, cut: list[str], result: Layout) -> int | None:
        """The head count where ``n`` views the cut features as heads (a new dimension,
        cut, smaller than the cut one before)."""
        layout = flow.layouts.get(cut[0])
        before, after = self.rules.size(self.nodes[cut[0]]), self.rules.size(n)
        if not (isinstance(result, Shard) and isinstance(layout, Shard)):
            return None
        if before is None or after is None or len(after) <= len(before):
            return None
        return int(after[result.dim]) if after[result.dim] < before[layout.dim] else None

    def _check_borders(self, flow: Flow) -> None:
        if not self.stage_of:
            return
        for name in flow.layouts:
            here = self.stage_of.get(name)
            for user in self.nodes[name].users:
                there = self.stage_of.get(user.name)
                if here is not None and there is not None and there != here:
                    flow.fail(
                        name,
                        f"the cut value {name} leaves stage {here} for stage {there} "
                        "(a boundary value is sent whole)",
                    )
