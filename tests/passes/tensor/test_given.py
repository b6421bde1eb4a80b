"""A plan given in torch's ``parallelize_module`` form: the found plan written in that form and
given back is found again (Llama, Qwen2); a plan of the MLPs alone cuts them and nothing
else (run on gloo ranks in tests/distributed/planning/test_tensor_parallel.py); a named cut the
search cannot make, a path that names nothing and a style fxpipe does not run are refused
with the reason."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from fxpipe.errors import ConfigError
from fxpipe.passes.tensor.given import given_plan
from fxpipe.passes.tensor.plan import tensor_plan
from fxpipe.passes.tensor.records import TensorPlan
from fxpipe.passes.tensor.torch_plan import torch_plan
from tests.passes.tensor.test_plan import planned

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

MLP = {
    "model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
}


def _given(name: str, styles: dict[str, Any]) -> TensorPlan:
    p = planned(name)
    return tensor_plan(p.gm, 2, p.example, given=given_plan(styles))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_the_found_plan_in_torchs_form_given_back_is_found_again(name: str) -> None:
    found = planned(name)
    form = torch_plan(found.plan, found.model)
    assert not form.missing
    again = _given(name, dict(form.styles))
    assert again.node_styles == found.plan.node_styles
    assert again.layouts == found.plan.layouts
    assert {k: (p.style, p.shard) for k, p in again.params.items()} == {
        k: (p.style, p.shard) for k, p in found.plan.params.items()
    }


def test_a_plan_of_the_mlps_alone_cuts_them_and_nothing_else() -> None:
    plan = _given("llama", MLP)
    cut = {plan.node_weights[n]: s for n, s in plan.node_styles.items()}
    assert cut == {
        f"model.layers.{i}.mlp.{proj}.weight": style
        for i in range(2)
        for proj, style in [("gate_proj", "colwise"), ("up_proj", "colwise"),
                            ("down_proj", "rowwise")]
    }  # fmt: skip
    q = next(n for n, p in planned("llama").plan.node_weights.items() if "q_proj" in p)
    assert plan.replicated[q].endswith("the given plan does not name it ColwiseParallel()")
    assert plan.params["model.embed_tokens.weight"].shard is None
    assert "does not name RowwiseParallel()" in plan.params["model.embed_tokens.weight"].reason


def test_a_column_cut_without_its_row_product_is_refused_naming_it() -> None:
    attention = {f"model.layers.*.self_attn.{x}_proj": ColwiseParallel() for x in "qkv"}
    with pytest.raises(ConfigError, match=r"o_proj RowwiseParallel\(\)") as err:
        _given("llama", attention)
    assert "self_attn.q_proj" in str(err.value) and "Leave it out" in str(err.value)


def test_a_cut_the_head_count_forbids_is_refused_with_the_reason() -> None:
    styles = {"blocks.*.attn.qkv": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel()}
    with pytest.raises(ConfigError, match="blocks.0.attn.qkv") as err:
        _given("odd_heads", styles)
    assert "3" in str(err.value)  # the head count tp=2 does not divide


@pytest.mark.parametrize(
    ("styles", "match"),
    [
        ({"model.layers.*.attn.q_proj": ColwiseParallel()}, "matches no module"),
        ({"model.norm": SequenceParallel()}, "is not run"),
        ({"model.layers.*.mlp.up_proj": ColwiseParallel(input_layouts=Shard(1))}, "is not run"),
        ({"model.layers.*.mlp.up_proj": ColwiseParallel(output_layouts=Shard(1))}, "not run"),
        ({"model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))}, "not run"),
        ({"model.layers.0.mlp.up_proj": RowwiseParallel(input_layouts=Replicate())}, "product"),
        ({}, "is not a plan"),
        ({3: ColwiseParallel()}, "the key 3"),
    ],
)
def test_what_a_given_plan_cannot_say_is_refused(styles: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _given("llama", styles)


def test_a_list_is_not_a_plan() -> None:
    with pytest.raises(ConfigError, match="is not a plan"):
        given_plan([("model.norm", ColwiseParallel())])
    assert torch.is_tensor(torch.zeros(1))  # torch still imports after the refusal
