"""pipe.generate() on encoder-decoders (T5, BART): the encoder run once per group through the
stages, the decoder's steps with each stage's self- and cross-attention caches, against
model.generate on the unpipelined model token for token (float32 and bfloat16);
Seq2SeqTrainer's evaluation."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import ConfigError
from tests.generation.test_driver import VOCAB, forward_forbidden, prompts

transformers = pytest.importorskip("transformers")


def t5(layers: int = 2) -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=layers,
        num_decoder_layers=layers, num_heads=4, dropout_rate=0.0, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def bart(layers: int = 2) -> nn.Module:
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, use_cache=False, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=0, forced_bos_token_id=None,
        forced_eos_token_id=None,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


def built(make: Callable[..., nn.Module], **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    return make(**kwargs).eval()


def source(model: nn.Module, rows: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of mixed lengths, padded with the model's pad token."""
    ids, mask = prompts(rows=rows)
    return ids.masked_fill(mask == 0, model.config.pad_token_id), mask


@contextmanager
def unpipelined_forbidden(model: nn.Module) -> Iterator[None]:
    """The model's forward and its encoder's raise when they run on real tensors."""
    with ExitStack() as stack:
        stack.enter_context(forward_forbidden(model))
        stack.enter_context(forward_forbidden(model.get_encoder()))
        yield


def pipelined(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, stages: int) -> Any:
    example = {"attention_mask": mask, "decoder_input_ids": ids[:, :3]}
    return fxpipe.pipeline(model, ids, ["cpu"] * stages, example_kwargs=example)


@pytest.mark.parametrize(
    ("make", "dtype"), [(t5, torch.float32), (bart, torch.bfloat16)], ids=["t5", "bart-bf16"]
)
def test_greedy_and_beam_search_equal_model_generate_token_for_token(
    make: Callable[..., nn.Module], dtype: torch.dtype
) -> None:
    model = built(make).to(dtype)  # transformers' own kernels in bfloat16 as in float32
    ids, mask = source(model)
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=8)
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=3)
    assert greedy.shape[1] > 3, "the oracle ends at once: a test that shows nothing"
    pipe = pipelined(model, ids, mask, stages=2)
    with unpipelined_forbidden(model):
        for lanes in (1, 2):
            out = pipe.generate(ids, attention_mask=mask, max_new_tokens=8, lanes=lanes)
            assert torch.equal(out, greedy), f"greedy, lanes={lanes}"
        out = pipe.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=3, lanes=2)
        assert torch.equal(out, beams)
    run = pipe.last_generation
    assert run is not None and run.lanes == 2 and run.rows == 5 * 3
    assert "encode" in run.variants and run.cache_bytes[-1] > 0, run
    gen = pipe._generator
    assert gen is not None
    layout = gen.layout()  # every layer's self- and cross-attention cache counted
    assert layout.layers[-1].cross and not layout.layers[0].cross
    per_lane = 3 * 3  # groups of 3 prompts, 3 beams each
    want = sum(layout.bytes(2 * per_lane, run.length, ids.shape[1]))
    assert sum(run.cache_bytes) == want
    # decoder inputs are refused with the remedy, and the model and the pipeline go on
    with pytest.raises(ConfigError, match="decoder_start_token_id"):
        pipe.generate(ids, attention_mask=mask, decoder_input_ids=ids[:, :2], max_new_tokens=3)
    assert "forward" not in vars(model) and "forward" not in vars(model.get_encoder())
    with unpipelined_forbidden(model):
        assert torch.equal(pipe.generate(ids, attention_mask=mask, max_new_tokens=8), greedy)


def test_four_stages_and_three_lanes_of_one_row_and_of_two() -> None:
    model = built(t5, layers=4)
    ids, mask = source(model, rows=5)
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=6)
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
    pipe = pipelined(model, ids, mask, stages=4)
    with unpipelined_forbidden(model):
        out = pipe.generate(ids, attention_mask=mask, max_new_tokens=6, lanes=3,
                            sequences_per_lane=1)  # fmt: skip
        assert torch.equal(out, greedy)
        out = pipe.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2, lanes=3)
        assert torch.equal(out, beams)
    run = pipe.last_generation
    assert run is not None and len(run.cache_bytes) == 4
    assert sum(b > 0 for b in run.cache_bytes) >= 2, run  # the decoder's layers span stages


def test_seq2seq_trainer_predicts_with_generate_through_the_stages(tmp_path: object) -> None:
    """Seq2SeqTrainer(predict_with_generate=True) on the pipeline: the predictions of the
    unpipelined model (the trainer's route into generate is the same for a decoder-only
    model)."""
    model = built(t5)
    ids, mask = source(model, rows=4)
    rows = [{"input_ids": i, "attention_mask": m, "labels": i} for i, m in zip(ids, mask)]
    args = transformers.Seq2SeqTrainingArguments(
        str(tmp_path), predict_with_generate=True, per_device_eval_batch_size=4,
        generation_max_length=6, generation_num_beams=2, report_to=[], use_cpu=True,
    )  # fmt: skip
    want = transformers.Seq2SeqTrainer(model=model, args=args).predict(rows).predictions
    pipe = pipelined(model, ids, mask, stages=2)
    with unpipelined_forbidden(model):
        got = transformers.Seq2SeqTrainer(model=pipe, args=args).predict(rows).predictions
    np.testing.assert_array_equal(got, want)
    assert pipe.last_generation is not None and pipe.last_generation.rows == 4 * 2
