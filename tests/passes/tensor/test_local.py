"""The local program each tp rank runs, without torch.distributed: the sizes the plan cuts are
divided by tp (the toy's head count, GPT-2's fused width and split, Llama's key/value heads
expanded), cut products become modules holding the model's own parameters at their paths,
the traced graph is left as it was; run whole (the plan's cuts over one rank) it computes
eager's outputs and gradients; a size read off a cut value reads the whole size; and what it
refuses."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.fx as fx
from helpers import logits_of
from oracle import relative_error
from torch import nn

from fxpipe.errors import ConfigError
from fxpipe.passes.tensor.cut_modules import CutEmbedding, CutInOut, CutLinear
from fxpipe.passes.tensor.local import local_program
from fxpipe.passes.tensor.local_sizes import cut_split_sizes, whole_shape
from fxpipe.passes.tensor.plan import tensor_plan
from fxpipe.passes.tensor.records import Shard
from fxpipe.trace.tracing import trace
from tests.passes.tensor.test_plan import planned

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def test_the_toy_heads_are_halved_and_its_products_are_modules_of_its_own_parameters() -> None:
    p = planned("toy")
    before = p.gm.code
    local = local_program(p.gm, p.plan)
    assert p.gm.code == before  # the traced graph is left as it was
    view = _node(local, "view")
    assert view.args[3:5] == (3, 2)  # (b, t, 3, heads, head_dim): 4 heads -> 2 per rank
    width = _node(local, "reshape").args[3]  # the attention's width, read off a whole value
    assert isinstance(width, fx.Node) and width.args[1] == 2  # ... divided by tp
    qkv = local.get_submodule("blocks.0.attn.qkv")
    assert type(qkv) is CutLinear and qkv.cut.weight == Shard(0, blocks=3)
    assert qkv.weight is p.gm.get_submodule("blocks.0.attn.qkv").weight  # the model's own
    assert type(local.get_submodule("tok")) is CutEmbedding
    head = local.get_submodule("linear")  # the LM head, tied to the lookup's weight
    assert type(head) is CutLinear and head.cut.style == "gathered"
    assert head.weight is local.get_submodule("tok").weight
    assert not [n for n in local.graph.nodes if n.op == "get_attr" and n.target == "tok.weight"]
    assert type(p.gm.get_submodule("blocks.0.attn.qkv")) is nn.Linear


def test_gpt2_fused_width_and_split_are_halved_and_conv1d_is_a_module() -> None:
    p = planned("gpt2")
    whole = dataclasses.replace(p.plan, sequence={}, sequence_gathers={}, unflattened={})
    assert _node(local_program(p.gm, whole), "view_6").args[1] == [-1, 32]  # c_proj's input
    # cut along the sequence, the Conv1D products read the tokens unflattened: the view that
    # flattened c_proj's input is gone, and it reads the (batch, tokens, 32) value itself
    local = local_program(p.gm, p.plan)
    assert not [n for n in local.graph.nodes if n.name == "view_6"]
    assert p.plan.unflattened["addmm_1"] == _node(p.gm, "view_6").args[0].name  # type: ignore[union-attr]
    assert _node(local, "view_2").args[1][2] == 96  # (b, t, 3 * 64) -> 3 * 32 per rank
    assert _node(local, "split").args[1:] == (32, 2)  # q, k, v of 64 features -> 32
    c_fc = local.get_submodule("transformer.h.0.mlp.c_fc")
    assert type(c_fc) is CutInOut and c_fc.cut.weight == Shard(1)  # stored (in, out)
    assert c_fc.bias is p.gm.get_parameter("transformer.h.0.mlp.c_fc.bias")
    assert not [n for n in local.graph.nodes if "addmm" in str(n.target)]


def test_llama_key_value_heads_expanded_and_reshaped_are_halved() -> None:
    p = planned("llama")
    local = local_program(p.gm, p.plan)
    expand = _node(local, "expand_3").args[1]
    assert expand[1:3] == [1, 2]  # 2 key/value heads -> 1, each repeated for 2 query heads
    assert _node(local, "reshape").args[1][1] == 2  # 4 query heads -> 2
    assert type(local.get_submodule("model.embed_tokens")) is CutEmbedding
    assert local.get_submodule("model.embed_tokens").padding_idx == 0


@pytest.mark.parametrize("name", ["toy", "gpt2", "llama"])
def test_run_whole_the_local_program_computes_eagers_outputs_and_gradients(name: str) -> None:
    """The plan's cuts over one rank: every product a generated module, nothing divided; the
    modules compute what the nodes they replace did (Conv1D's ``x @ W + b`` included). (A
    value cut along the sequence is a DTensor, which needs the ranks:
    ``test_parallelize.py``.)"""
    p = planned(name)
    one = dataclasses.replace(p.plan, tp=1, sequence={}, sequence_gathers={})
    local = local_program(p.gm, one)
    generated = [m for m in local.modules() if type(m) in (CutLinear, CutInOut, CutEmbedding)]
    assert len(generated) == len(p.plan.node_styles)  # one per cut node
    got, want = logits_of(local(*p.example)), logits_of(p.gm(*p.example))
    assert relative_error(got, want) < 1e-6
    params = dict(p.gm.named_parameters())
    weights = torch.linspace(-1.0, 1.0, want.numel()).reshape(want.shape)
    ours = torch.autograd.grad((got * weights).sum(), list(params.values()), allow_unused=True)
    eager = torch.autograd.grad((want * weights).sum(), list(params.values()))
    for key, a, b in zip(params, ours, eager):
        assert a is not None, key
        assert relative_error(a, b) < 1e-6, key


class ReadsShape(nn.Module):
    """Heads split off sizes read from the column-wise product's own (cut) output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        b, t, c = h.shape
        h = h.view(b, t, 4, c // 4).softmax(-1).reshape(b, t, c)
        return self.fc2(h)


def _summed_over_ranks(local: fx.GraphModule, x: torch.Tensor, tp: int) -> torch.Tensor:
    """Each rank's program run alone on its own pieces of the generated modules' weights (as
    their cuts say; a row-wise bias on rank 0 only), the outputs summed: the all-reduce of
    a model that ends in a row-wise product."""
    total = torch.zeros(())
    for rank in range(tp):
        mine = copy.deepcopy(local)
        for m in mine.modules():
            if type(m) not in (CutLinear, CutInOut):
                continue
            for name, shard in (("weight", m.cut.weight), ("bias", m.cut.bias)):
                value = getattr(m, name)
                if value is None:
                    continue
                if shard is not None:
                    value = shard.take(value.detach(), tp, rank)
                elif m.cut.style == "rowwise" and rank:
                    value = torch.zeros_like(value)
                setattr(m, name, nn.Parameter(value.detach().clone()))
        total = total + mine(x)[0]  # the traced graph returns a tuple
    return total


def test_sizes_read_off_a_cut_value_are_its_whole_sizes() -> None:
    model, x = ReadsShape(), torch.randn(2, 3, 16)
    gm = trace(model, (x,)).graph_module
    plan = tensor_plan(gm, 2, (x,))
    assert plan.node_styles == {"fc1": "colwise", "fc2": "rowwise"}
    local = local_program(gm, plan)
    assert any(n.target is whole_shape for n in local.graph.nodes)
    torch.testing.assert_close(_summed_over_ranks(local, x, 2), model(x))


class SplitAttention(nn.Module):
    """GPT-2's attention in fx form: a fused q, k, v split along dim -1 by a size read off
    the input, heads viewed off the input's width."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(16, 48), nn.Linear(16, 16), 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = torch.softmax(q @ k.transpose(-2, -1), -1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def test_a_split_along_a_negative_dim_by_a_computed_size_is_cut_at_run_time() -> None:
    model, x = SplitAttention(), torch.randn(2, 5, 16)
    gm = trace(model, (x,)).graph_module
    plan = tensor_plan(gm, 2, (x,))
    assert plan.params["qkv.weight"].shard == Shard(0, blocks=3)
    local = local_program(gm, plan)
    assert [n.name for n in local.graph.nodes if n.op == "call_module"] == ["qkv", "proj"]
    assert any(n.target is cut_split_sizes for n in local.graph.nodes)
    torch.testing.assert_close(_summed_over_ranks(local, x, 2), model(x))


def test_a_size_tp_does_not_divide_is_refused_naming_it() -> None:
    p = planned("toy")
    wrong = dataclasses.replace(p.plan, tp=3)
    with pytest.raises(ConfigError, match=r"names a size of 4 .* tp=3 does not divide"):
        local_program(p.gm, wrong)


def test_the_plan_of_another_graph_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"cuts nodes \[.*\] the graph does not have"):
        local_program(planned("toy").gm, planned("llama").plan)


class Frequencies(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8, scale_grad_by_freq=True)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def test_an_embedding_scaled_by_frequency_is_refused() -> None:
    model, ids = Frequencies(), torch.randint(0, 16, (2, 5))
    gm = trace(model, (ids,)).graph_module
    plan = tensor_plan(gm, 2, (ids,))
    assert plan.node_styles.get("emb") == "vocab"
    with pytest.raises(ConfigError, match=r"scale_grad_by_freq=True.*leave them at"):
        local_program(gm, plan)
