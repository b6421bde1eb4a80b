"""The records of a finished search: the style of each product and parameter, the groups,
the LM heads (cut by vocabulary, logits all-gathered), the embeddings (cut by rows), and why
everything else stays whole."""

from __future__ import annotations

from operator import attrgetter

import torch.fx as fx

from fxpipe.passes.ops import op_name
from fxpipe.passes.tensor.cuts import ATTENTION_OPS
from fxpipe.passes.tensor.products import Embedding, Product
from fxpipe.passes.tensor.records import (
    GroupKind,
    NodeStyle,
    ParamShard,
    Shard,
    ShardGroup,
    Style,
    TensorPlan,
)
from fxpipe.passes.tensor.search import Flow, Search

__all__ = ["Assembly"]

_SIZE_READS = frozenset({"sym_size", "size", "getattr", "dim", "numel"})
#: Ops that read q, k and v (or scores and v) together: where one of them is whole, the
#: reason it is whole explains why the others cannot stay cut.
_ATTENTION_READS = ATTENTION_OPS | {"matmul", "bmm"}
#: How many nodes back a failure's explanation looks for the products that made it.
_LOOK_BACK = 512


class Assembly:
    """The records of a finished search: styles of nodes and parameters, the groups, the
    LM heads and embeddings, the reasons for what stays whole."""

    def __init__(self, search: Search, flow: Flow, embeddings: dict[str, Embedding]) -> None:
        self.search, self.flow, self.embeddings = search, flow, embeddings
        self.tp = search.rules.tp
        self.styles: dict[str, NodeStyle] = {}
        self.params: dict[str, ParamShard] = {}
        self.groups: list[ShardGroup] = []

    def plan(self) -> TensorPlan:
        self._pairs()
        heads = self._heads()
        self._embeddings(heads)
        self._whole()
        replicated = {
            name: self._why_whole(name) for name in self.search.products if name not in self.styles
        }
        return TensorPlan(
            tp=self.tp,
            params=dict(sorted(self.params.items(), key=lambda kv: self._first_reader(kv[1]))),
            groups=tuple(sorted(self.groups, key=self._group_order)),
            layouts=dict(self.flow.layouts),
            node_styles=dict(self.styles),
            node_weights={name: self._weight_of(name) for name in self.styles},
            replicated=replicated,
            stage_of=dict(self.search.stage_of),
        )

    def _weight_of(self, name: str) -> str:
        product = self.search.products.get(name)
        return product.weight if product is not None else self.embeddings[name].weight

    def _group_order(self, group: ShardGroup) -> int:
        return min(self.search.order[n] for n in group.columns + group.rows)

    def _why_whole(self, name: str) -> str:
        """Why product ``name`` is whole: the group it would end failed, else why its own
        cut fails."""
        search = self.search
        if name in search.ends:
            return search.ends[name]
        own = search.reasons.get(name, "no product contracts its cut") + self._upstream(name)
        return f"no kept group ends in it, and cut by its output features: {own}"

    def _upstream(self, name: str) -> str:
        """Why the whole inputs of the node product ``name``'s cut failed at are whole, where
        they come from products left whole for another reason (attention whose key is whole
        because its key-value head count does not divide by tp)."""
        search = self.search
        at = search.failed_at.get(name)
        if at is None or op_name(search.nodes[at]) not in _ATTENTION_READS:
            return ""
        own = search.reasons.get(name)
        found = []
        for source in self._products_behind(search.nodes[at]):
            why = search.reasons.get(source)
            if source != name and why is not None and why != own and source not in self.styles:
                found.append(f"{source} is whole: {why}")
        return f" ({'; '.join(found)})" if found else ""

    def _products_behind(self, n: fx.Node) -> list[str]:
        """The products whose values reach ``n`` through no other product (nearest first)."""
        search, out = self.search, []
        todo, seen = list(n.all_input_nodes), set[fx.Node]()
        while todo and len(seen) < _LOOK_BACK:
            node = todo.pop(0)
            if node in seen:
                continue
            seen.add(node)
            if node.name in search.products:
                out.append(node.name)
            else:
                todo.extend(node.all_input_nodes)
        return out

    def _first_reader(self, p: ParamShard) -> int:
        order = self.search.order
        return min((order[r] for r in p.readers if r in order), default=len(order))

    def _param(
        self, name: str | None, style: Style, shard: Shard | None, reason: str
    ) -> str | None:
        if name is None:
            return None
        value = attrgetter(name)(self.search.gm)
        readers = tuple(self.search.readers.get(name, ()))
        product = any(name in (p.weight, p.bias) for p in self.search.products.values())
        self.params[name] = ParamShard(
            name, style, shard, reason, tuple(value.shape), product, readers
        )
        return name

    def _pairs(self) -> None:
        search, flow = self.search, self.flow
        groups = search.groups(flow)
        for root in sorted(groups, key=lambda r: search.order[groups[r][0]]):
            columns, rows = groups[root], flow.rows.get(root, {})
            kind: GroupKind = "attention" if root in flow.attention else "mlp"
            heads = tuple(sorted(flow.heads.get(root, set()), reverse=True))
            reason = f"{kind} group of {', '.join(columns)}"
            params: list[str | None] = []
            for c in columns:
                p, parts = search.products[c], search.parts[c][search.choice[c]]
                self.styles[c] = "colwise"
                params.append(self._param(p.weight, "colwise", Shard(p.out_dim, parts), reason))
                params.append(self._param(p.bias, "colwise", Shard(0, parts), reason))
            for r in sorted(rows, key=search.order.__getitem__):
                p = search.products[r]
                self.styles[r] = "rowwise"
                cut = Shard(1 - p.out_dim, rows[r])
                after = reason + "; added once, after the all-reduce"
                params.append(self._param(p.weight, "rowwise", cut, reason))
                params.append(self._param(p.bias, "rowwise", None, after))
            self.groups.append(
                ShardGroup(
                    kind,
                    tuple(columns),
                    tuple(sorted(rows, key=search.order.__getitem__)),
                    heads,
                    tuple(p for p in params if p is not None),
                )
            )

    def _heads(self) -> dict[str, str]:
        """LM heads cut by vocabulary, logits all-gathered: weight name -> head node."""
        out: dict[str, str] = {}
        for name, p in self.search.products.items():
            allowed = self.search.allowed[name]
            if allowed is not None and "gathered" not in allowed:
                continue  # the user's plan does not gather it
            if name in self.styles or not self._is_head(p):
                continue
            reason = f"LM head: {p.out_features} vocabulary rows cut, logits all-gathered"
            self.styles[name] = "gathered"
            params = [
                self._param(p.weight, "colwise", Shard(p.out_dim), reason),
                self._param(p.bias, "colwise", Shard(0), reason),
            ]
            self.groups.append(
                ShardGroup("lm_head", (name,), (), (), tuple(x for x in params if x))
            )
            out[p.weight] = name
        return out

    def _is_head(self, p: Product) -> bool:
        """The last product before the graph's output, at least as wide out as in (or tied
        to an embedding), whose parameters only it (and embeddings) read."""
        if p.out_features % self.tp or (p.out_features < p.in_features and not self._tied(p)):
            return False
        lookups = {e.node for e in self.embeddings.values()}
        for param in (p.weight, p.bias):
            if param and any(r not in lookups | {p.node} for r in self.search.readers[param]):
                return False
        tied = [e for e in self.embeddings.values() if e.weight == p.weight]
        if tied and (p.bias or p.out_dim != 0):
            return False  # the embedding's rows must be the head's cut rows, and nothing else
        if any(self._embedding_refusal(e, {p.weight: p.node}) for e in tied):
            return False  # a tied embedding left whole reads the weight whole: so does the head
        return self._reaches_output_alone(p.node)

    def _tied(self, p: Product) -> bool:
        return any(e.weight == p.weight for e in self.embeddings.values()) and p.out_dim == 0

    def _reaches_output_alone(self, name: str) -> bool:
        """Whether the value of ``name`` reaches the output with no other product, nor
        embedding, on the way."""
        todo, seen, output = [self.search.nodes[name]], set[fx.Node](), False
        while todo:
            n = todo.pop()
            for u in n.users:
                if u.name in self.search.products or u.name in self.embeddings:
                    return False
                output |= u.op == "output"
                if u not in seen:
                    seen.add(u)
                    todo.append(u)
        return output

    def _embeddings(self, heads: dict[str, str]) -> None:
        for name, e in self.embeddings.items():
            reason = self._embedding_refusal(e, heads)
            if reason is not None:
                self._param(e.weight, "replicated", None, reason)
                continue
            self.styles[name] = "vocab"
            tied = f", tied to the LM head {heads[e.weight]}" if e.weight in heads else ""
            text = f"embedding: {e.rows} rows cut, lookups all-reduced{tied}"
            self._param(e.weight, "vocab", Shard(0), text)
            self.groups.append(ShardGroup("embedding", (), (name,), (), (e.weight,)))

    def _embedding_refusal(self, e: Embedding, heads: dict[str, str]) -> str | None:
        """Why embedding ``e`` is not cut by rows (``heads``: weight -> the LM head that may
        read it cut alike), or None."""
        allowed_of = self.search.allowed_of
        if allowed_of is not None:
            if not allowed_of(e.weight) & {"embedding", "rowwise"}:
                return "embedding the given plan does not name RowwiseParallel()"
        if e.rows % self.tp:
            return f"embedding of {e.rows} rows, which do not divide by tp={self.tp}"
        if not self._from_input(e.ids):
            return "embedding indexed by positions the model computes (a small table)"
        lookups = {x.node for x in self.embeddings.values()}
        others = [
            r
            for r in self.search.readers.get(e.weight, [])
            if r not in lookups and heads.get(e.weight) != r
        ]
        if others:
            return f"embedding whose weight is also read whole by {', '.join(others)}"
        return None

    def _from_input(self, name: str) -> bool:
        """Whether the indices ``name`` come from a graph input (not from sizes alone)."""
        todo, seen = [self.search.nodes[name]], set[fx.Node]()
        while todo:
            n = todo.pop()
            if n.op == "placeholder":
                return True
            if n in seen or op_name(n) in _SIZE_READS:
                continue
            seen.add(n)
            todo.extend(n.all_input_nodes)
        return False

    def _kind(self, n: fx.Node) -> str:
        if n.op == "call_module":
            return type(self.search.gm.get_submodule(str(n.target))).__name__
        return op_name(n)

    def _whole(self) -> None:
        """Every parameter not yet placed: whole on every rank, with the reason."""
        for name, readers in self.search.readers.items():
            if name in self.params:
                continue
            owner = next(
                (p for p in self.search.products.values() if name in (p.weight, p.bias)), None
            )
            if owner is not None:
                reason = self._why_whole(owner.node)
                self._param(name, "replicated", None, f"{owner.node} left whole: {reason}")
            else:
                kinds = sorted({self._kind(self.search.nodes[r]) for r in readers})
                self._param(
                    name,
                    "replicated",
                    None,
                    f"read by {', '.join(kinds)} (a norm or element-wise parameter)",
                )
