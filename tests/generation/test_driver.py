"""pipe.generate(): the model's own generate loop through the stages, against model.generate
on the unpipelined model (the oracle): greedy and beam search token for token, left padding
and mixed prompt lengths, lanes and groups, the model's forward never called."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import fxpipe
from fxpipe.errors import ConfigError, UninitialisedError

transformers = pytest.importorskip("transformers")

VOCAB = 61
EOS = 2


def _common() -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=EOS
    )


def gpt2(layers: int = 2) -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=32, n_head=4, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
        embd_pdrop=0.0, **_common(),
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama(layers: int = 2) -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, **_common(),
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def qwen2(layers: int = 2) -> nn.Module:
    config = transformers.Qwen2Config(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **_common(),
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


def mixtral(layers: int = 2) -> nn.Module:
    config = transformers.MixtralConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4,
        num_experts_per_tok=2, **_common(),
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def gemma3(layers: int = 2) -> nn.Module:
    config = transformers.Gemma3TextConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2), **_common(),
    )  # a window shorter than the prompt, per-head q/k norms  # fmt: skip
    return transformers.Gemma3ForCausalLM(config)


def llama4(layers: int = 2) -> nn.Module:
    config = transformers.Llama4TextConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
        attention_chunk_size=4, **_common(),
    )  # experts on every layer, attention in chunks shorter than the prompt  # fmt: skip
    return transformers.Llama4ForCausalLM(config)


def prompts(rows: int = 5, length: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and mask, left-padded to mixed lengths (rows 1 and 3 shorter)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    for row, pad in ((1, 3), (3, 2)):
        if row < rows:
            mask[row, :pad] = 0
    return ids.masked_fill(mask == 0, 0), mask


def built(make: Callable[..., nn.Module], stages: int = 2, **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    return make(**kwargs).eval()


@contextmanager
def forward_forbidden(model: nn.Module) -> Iterator[None]:
    """Within the block, the model's own forward raises when it runs on real tensors (tracing
    it, on fake or meta tensors, is how the stages are made)."""
    cls = type(model)
    original = cls.forward

    @functools.wraps(original)  # generate reads the forward's signature
    def refuse(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        leaves = [*args, *kwargs.values()]
        if any(isinstance(v, torch.Tensor) and _real(v) for v in leaves):
            raise AssertionError("the unpipelined forward ran")
        return original(self, *args, **kwargs)

    cls.forward = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.forward = original  # type: ignore[method-assign]


def _real(t: torch.Tensor) -> bool:
    return not t.is_meta and not isinstance(t, FakeTensor)


@pytest.mark.parametrize(
    "make", [gpt2, llama, qwen2, mixtral, gemma3, llama4], ids=lambda f: f.__name__
)
def test_greedy_and_beam_search_equal_model_generate_token_for_token(
    make: Callable[..., nn.Module],
) -> None:
    model = built(make)
    ids, mask = prompts()
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=3)
    pipe = fxpipe.pipeline(model, ids, ["cpu"] * 2, example_kwargs={"attention_mask": mask})
    with forward_forbidden(model):
        for lanes in (1, 2):
            out = pipe.generate(ids, attention_mask=mask, max_new_tokens=8, lanes=lanes)
            assert torch.equal(out, greedy), f"greedy, lanes={lanes}"
        out = pipe.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=3)
        assert torch.equal(out, beams)
    run = pipe.last_generation  # lanes="auto": stages sharing one device take turns, one lane
    assert run is not None and run.lanes == 1 and run.rows == 5 * 3
    assert all(b > 0 for b in run.cache_bytes), run  # each stage holds layers' caches


@pytest.mark.parametrize("make", [llama, gemma3], ids=lambda f: f.__name__)
def test_prompts_in_chunks_give_the_model_own_tokens(
    make: Callable[..., nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fxpipe.generation import Generator

    model = built(make)  # gemma3: a sliding window of 4, shorter than a chunk's reach
    ids, mask = prompts(rows=5, length=9)
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=6)
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
    pipe = fxpipe.pipeline(model, ids, ["cpu"] * 2, example_kwargs={"attention_mask": mask})
    steps: list[int] = []
    through = Generator._through

    def counted(self: Any, ring: Any, lane: int, variant: Any, values: Any, cache: Any) -> Any:
        steps.append(int(values[0].shape[1]))
        return through(self, ring, lane, variant, values, cache)

    monkeypatch.setattr(Generator, "_through", counted)
    with forward_forbidden(model):
        out = pipe.generate(ids, attention_mask=mask, max_new_tokens=6, lanes=2, prefill_chunk=4)
        assert torch.equal(out, greedy)
        assert steps.count(4) == 2 and steps.count(5) == 2, steps  # 9 tokens: 4, then 5
        out = pipe.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2,
                            prefill_chunk=2)  # fmt: skip
        assert torch.equal(out, beams)


def test_in_bfloat16_with_grouped_experts_the_tokens_are_the_model_own() -> None:
    model = built(mixtral).to(torch.bfloat16)  # transformers' grouped experts in bfloat16
    ids, mask = prompts()
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=8)
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=3)
    pipe = fxpipe.pipeline(model, ids, ["cpu"] * 2, example_kwargs={"attention_mask": mask})
    assert torch.equal(pipe.generate(ids, attention_mask=mask, max_new_tokens=8, lanes=2), greedy)
    out = pipe.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=3, lanes=2)
    assert torch.equal(out, beams)
    assert pipe._generator.layout().layers[0].dtype == torch.bfloat16  # type: ignore[union-attr]


def test_a_model_built_on_meta_generates_only_once_loaded_and_then_its_own_tokens() -> None:
    """Mixtral in bfloat16 built on ``meta`` (its grouped experts traced as the CPU runs
    them): generate() before loading is refused, as a call is, rather than run on the
    stages' uninitialised memory; the remedy followed, the tokens are the model's."""
    model = built(mixtral).to(torch.bfloat16)
    with torch.device("meta"):
        empty = built(mixtral).to(torch.bfloat16)
    ids, mask = prompts()
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=6)
    pipe = fxpipe.pipeline(empty, ids, ["cpu"] * 2, example_kwargs={"attention_mask": mask})
    with pytest.raises(UninitialisedError, match="load_state_dict"):
        pipe.generate(ids, attention_mask=mask, max_new_tokens=6)
    pipe.load_state_dict({**model.state_dict(), **dict(model.named_buffers())})
    assert torch.equal(pipe.generate(ids, attention_mask=mask, max_new_tokens=6, lanes=2), greedy)


def test_four_stages_four_lanes_five_groups_a_lane_takes_the_next_group_when_done() -> None:
    model = built(llama, layers=4)
    ids, mask = prompts(rows=10)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=9, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 2])  # row 0 ends after its third token: its group early
    config = transformers.GenerationConfig(max_new_tokens=9, eos_token_id=eos, pad_token_id=0)
    want = model.generate(ids, attention_mask=mask, generation_config=config)
    assert (want[0, ids.shape[1] + 3 :] == 0).all()
    pipe = fxpipe.pipeline(model, ids, ["cpu"] * 4, example_kwargs={"attention_mask": mask})
    with forward_forbidden(model), fxpipe.record(pipe) as timeline:
        out = pipe.generate(
            ids, attention_mask=mask, generation_config=config, lanes=4, sequences_per_lane=2
        )
    assert torch.equal(out, want)
    seen = {(t.i, t.j) for t in timeline.tasks}  # the timeline shows each lane at each stage
    assert seen == {(i, j) for i in range(4) for j in range(4)}
    run = pipe.last_generation
    assert run is not None and (run.lanes, run.groups) == (4, 5)
    layout = pipe._generator.layout()  # type: ignore[union-attr]
    per_layer = layout.bytes(4 * 2, run.length)  # 4 lanes of 2 rows
    assert run.cache_bytes == per_layer  # one layer per stage
    table = run.summary().splitlines()
    assert len(table) == 2 + 4 and "4 lane(s), 5 group(s)" in table[0]
    assert table[2].split()[:2] == ["0", "cpu"]
    assert float(table[2].split()[3]) == pytest.approx(per_layer[0] / 2**20, abs=0.01)


def test_sampling_with_one_lane_is_the_model_sampling_under_the_same_seed() -> None:
    model = built(qwen2)
    ids, mask = prompts()
    kwargs: dict[str, Any] = dict(attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=5)
    torch.manual_seed(7)
    want = model.generate(ids, **kwargs)
    pipe = fxpipe.pipeline(model, ids, ["cpu"] * 2, example_kwargs={"attention_mask": mask})
    torch.manual_seed(7)
    assert torch.equal(pipe.generate(ids, **kwargs), want)
    with pytest.raises(ConfigError, match="lanes=1") as e:
        pipe.generate(ids, **kwargs, lanes=2)
    assert "do_sample" in str(e.value)


def test_what_is_not_run_is_refused_with_a_remedy_that_works() -> None:
    model = built(gpt2)
    ids, mask = prompts()
    pipe = fxpipe.pipeline(model, ids, ["cpu"] * 2, example_kwargs={"attention_mask": mask})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match="use_cache"):
        pipe.generate(ids, attention_mask=mask, use_cache=False)
    with pytest.raises(ConfigError, match="assisted decoding"):
        pipe.generate(ids, attention_mask=mask, assistant_model=model)
    with pytest.raises(ConfigError, match="sequences_per_lane=5") as e:
        pipe.generate(
            ids, attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True, lanes=2
        )
    assert "lanes=1" in str(e.value)
    whole = pipe.generate(
        ids, attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True,
        lanes=1, sequences_per_lane=5,
    )  # fmt: skip
    want = model.generate(ids, attention_mask=mask, max_new_tokens=3, return_dict_in_generate=True)
    assert torch.equal(whole.sequences, want.sequences)
    after = model.state_dict()  # generation wrote only its own cache
    assert "forward" not in vars(model) and all(torch.equal(before[k], after[k]) for k in before)
    pipe.train()  # and the pipeline still trains as it did
    torch.testing.assert_close(
        pipe(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    )


def test_a_model_with_recurrent_state_is_refused_with_what_to_do() -> None:
    config = transformers.MambaConfig(
        num_hidden_layers=2, hidden_size=32, state_size=4, vocab_size=VOCAB, use_cache=False
    )
    model = transformers.MambaForCausalLM(config).eval()
    ids, _ = prompts()
    pipe = fxpipe.pipeline(model, ids, ["cpu"] * 2)
    with forward_forbidden(model), pytest.raises(ConfigError, match="recurrent") as e:
        pipe.generate(ids, max_new_tokens=3)
    assert "own generate()" in str(e.value)


def test_a_cache_over_the_memory_budget_is_refused_and_fewer_rows_per_lane_fit() -> None:
    import dataclasses

    from fxpipe.errors import MemoryPlanError
    from fxpipe.generation import Generator

    model = built(llama, layers=2)
    ids, mask = prompts(rows=6)
    pipe = fxpipe.pipeline(model, ids, ["cpu"] * 2, example_kwargs={"attention_mask": mask})
    length = ids.shape[1] + 6
    row_bytes = 2 * 2 * 8 * 4 * length  # one layer's keys and values: 2 heads of 8, float32
    room = 3 * row_bytes + 100  # a budget the weights and three rows of cache fit (per stage)
    first = pipe._session.variants.first
    plan = dataclasses.replace(
        first.plan, capacities=tuple(s.param_bytes + room for s in first.plan.stages)
    )
    generator = Generator(model, plan, first.program)
    kwargs: dict[str, Any] = dict(attention_mask=mask, max_new_tokens=6, lanes=1)
    with pytest.raises(MemoryPlanError, match="sequences_per_lane") as e:
        generator.generate((ids,), dict(kwargs))
    assert "stage 0" in str(e.value) and str(room + first.plan.stages[0].param_bytes) in str(
        e.value
    )
    out = generator.generate((ids,), dict(kwargs, sequences_per_lane=3))
    assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=6))
