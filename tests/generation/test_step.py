"""One generation step split along the pipeline's borders: each layer's cache is read and
written by the stage that holds that layer's weights, in every variant (prefill, decode,
lanes of one row), and the step equals the model's own forward with its cache."""

from __future__ import annotations

import pytest
import torch

import fxpipe
from fxpipe.generation import Generator
from fxpipe.ir import PipelinePlan
from tests.generation.test_driver import built, llama, prompts

transformers = pytest.importorskip("transformers")


def _weight_stage(plan: PipelinePlan, target: str) -> int:
    for node in plan.graph_module.graph.nodes:
        if node.op == "get_attr" and node.target == target:
            return plan.stage_of[node.name]
    raise KeyError(target)


def test_each_layer_cache_lives_on_one_stage_and_nothing_of_it_crosses_a_border() -> None:
    model = built(llama, layers=4)
    ids, mask = prompts()
    pipe = fxpipe.pipeline(model, ids, ["cpu"] * 3, example_kwargs={"attention_mask": mask})
    first = pipe._session.variants.first
    generator = Generator(model, first.plan, first.program)
    weights = [_weight_stage(pipe.plan, f"model.layers.{i}.self_attn.{p}_proj.weight")
               for i in range(4) for p in "kv"]  # fmt: skip
    assert len(set(weights)) == 3 and weights != sorted(weights)[:1] * 8
    for kind, rows in (("prefill", 3), ("decode", 3), ("decode", 1)):
        variant = generator.variant(kind, rows)  # type: ignore[arg-type]
        stages = variant.cache_stage
        assert stages[0::2] == stages[1::2], (kind, stages)  # keys and values together
        assert list(stages) == sorted(stages) and len(set(stages)) > 1
        assert all(min(w) <= s for s, w in zip(stages, zip(weights, weights[1:] + [9])))
        gm = variant.plan.graph_module
        length = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "caches_0")
        symbol = length.meta["val"].shape[2]
        sent = {x for stage in variant.plan.stages for x in stage.outputs}
        for node in gm.graph.nodes:
            value = node.meta.get("val")
            computed = node.op != "placeholder"  # inputs go to their readers from the caller
            if (
                computed
                and node.name in sent
                and isinstance(value, torch.Tensor)
                and value.ndim == 4
            ):
                assert str(value.shape[2]) != str(symbol), (
                    kind,
                    node.name,
                )  # (rows, heads, len, d)
        names = variant.program.graph_inputs[4:]
        for name, stage in zip(names, stages, strict=True):
            readers = [j for j, inputs in enumerate(variant.program.inputs) if name in inputs]
            assert readers == [stage]


def test_a_prefill_then_a_decode_step_equal_the_model_with_its_own_cache() -> None:
    from fxpipe.generation.cache import StageCaches, lane_cache
    from fxpipe.generation.ring import Ring

    model = built(llama, layers=2)
    ids, mask = prompts(rows=3)
    pipe = fxpipe.pipeline(model, ids, ["cpu"] * 2, example_kwargs={"attention_mask": mask})
    first = pipe._session.variants.first
    generator = Generator(model, first.plan, first.program)
    length, (rows, tokens) = 12, ids.shape
    caches = StageCaches(generator.layout(), [torch.device("cpu")] * 2, rows, length)
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    whole = torch.zeros(rows, length, dtype=torch.long)
    whole[:, :tokens] = mask
    eager = model(ids, attention_mask=mask, position_ids=position, use_cache=True)
    with Ring(first.plan.devices, threads=False) as ring:
        prefill = generator.variant("prefill", rows).program
        values = [ids, whole, position, torch.arange(tokens), *caches.tensors]
        logits = ring.step(0, prefill, values)
        torch.testing.assert_close(logits, eager.logits[:, -1:])
        nxt = logits.argmax(-1)
        whole[:, tokens] = 1
        step_position = position[:, -1:] + 1
        decode = generator.variant("decode", rows).program
        values = [nxt, whole, step_position, torch.tensor([tokens]), *caches.tensors]
        logits = ring.step(0, decode, values)
    full_mask = torch.cat([mask, torch.ones(rows, 1, dtype=torch.long)], 1)
    again = model(
        nxt, attention_mask=full_mask, position_ids=step_position,
        cache=eager.cache, use_cache=True,
    )  # fmt: skip
    torch.testing.assert_close(logits, again.logits[:, -1:])
    assert lane_cache(caches.rows_of(0, rows)).get_seq_length() == 0
