"""Hugging Face transformers (small configs, no download) through fxpipe.pipeline: outputs
and every parameter's gradient against the eager model's; a loss computed inside refused."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import SLOW
from oracle import relative_error
from torch import nn

import fxpipe
from fxpipe.errors import PlanError

# In the ``test`` extra; .ci/run fails when it does not import, so this never skips there.
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 97
BATCH, LENGTH = 4, 12


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, use_cache=False,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    return transformers.BertModel(config)


def t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def vit() -> nn.Module:
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.ViTModel(config)


def inputs(with_labels: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH))
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, 9:] = 0  # one padded sequence
    out = {"attention_mask": mask}
    if with_labels:
        out["labels"] = ids.clone()
    return {"input_ids": ids, **out}


def text() -> tuple[tuple[Any, ...], dict[str, Any]]:
    batch = inputs(False)
    return (batch.pop("input_ids"),), batch


def text_to_text() -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kwargs = text()
    return args, {**kwargs, "decoder_input_ids": torch.randint(1, VOCAB, (BATCH, 7))}


def images() -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (torch.randn(BATCH, 3, 16, 16, dtype=torch.float64),), {}


def scalar(output: Any, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """A fixed random projection of the output's tensors."""
    return sum((output[k] * w).sum() for k, w in weights.items())


Example = Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]
#: (name, model, example, stages).
CASES: list[tuple[str, Callable[[], nn.Module], Example, int]] = [
    ("gpt2", gpt2, text, 3),
    ("llama", llama, text, 2),
    ("bert", bert, text, 3),
    ("t5", t5, text_to_text, 3),  # encoder-decoder: cross-attention, two token inputs
    ("vit", vit, images, 2),
]


@pytest.mark.parametrize(
    ("name", "build", "example", "stages"),
    # vit in the quick subset (llama is slow as a zoo name too: tests/conftest.py)
    [pytest.param(*c, id=c[0], marks=() if c[0] == "vit" else SLOW) for c in CASES],
)
def test_hf_model_matches_eager(
    name: str, build: Callable[[], nn.Module], example: Example, stages: int
) -> None:
    model = build().double()
    reference = copy.deepcopy(model)
    args, kwargs = example()

    want = reference(*args, **kwargs)
    pipe = fxpipe.pipeline(model, args, ["cpu"] * stages, example_kwargs=kwargs, chunks=2)
    assert pipe.plan.num_stages == stages
    got = pipe(*args, **kwargs)

    assert type(got) is type(want)
    assert list(got.keys()) == list(want.keys())
    for key in want.keys():
        assert relative_error(got[key], want[key]) < 1e-10, key

    weights = {k: torch.randn(v.shape, dtype=v.dtype) for k, v in want.items()}
    scalar(want, weights).backward()
    scalar(got, weights).backward()
    grads = dict(reference.named_parameters())
    for path, p in model.named_parameters():
        want_grad = grads[path].grad
        assert (p.grad is None) == (want_grad is None), path
        if want_grad is not None:
            # A key bias's gradient is zero in exact arithmetic (softmax ignores a shift
            # shared by every score of a query): both sides are rounding noise there.
            diff = (p.grad - want_grad).norm().item()
            assert diff <= 1e-10 * want_grad.norm().item() + 1e-14, path
    assert list(pipe.state_dict()) == list(model.state_dict())


@pytest.mark.slow
def test_hf_tied_head_lives_in_one_stage() -> None:
    """GPT-2's LM head is its token embedding: one Parameter, held by one stage only."""
    model = gpt2()
    batch = inputs(False)
    ids = batch.pop("input_ids")
    pipe = fxpipe.pipeline(model, ids, ["cpu"] * 3, example_kwargs=batch)
    tied = model.transformer.wte.weight
    assert model.lm_head.weight is tied
    holders = [
        j for j, stage in enumerate(pipe.stages) if any(p is tied for p in stage.parameters())
    ]
    assert len(holders) == 1


def bert_classifier() -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def text_labels(length: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Token ids with a padded row, and labels that skip the padding (-100)."""
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(1, VOCAB, (BATCH + 1, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, length - 3 :] = 0
    labels = torch.where(mask.bool(), ids, -100)
    return (ids,), {"attention_mask": mask, "labels": labels}


def class_labels(length: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kwargs = text_labels(length)
    g = torch.Generator().manual_seed(length + 1)
    return args, {**kwargs, "labels": torch.randint(0, 3, (BATCH + 1,), generator=g)}


def seq2seq_labels(length: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    args, kwargs = text_labels(length)
    return args, {**kwargs, "labels": kwargs["labels"][:, : length // 2 + 1].contiguous()}


#: (name, model, example of a sequence length with labels); the loss is the model's.
LOSS_CASES: list[tuple[str, Callable[[], nn.Module], Callable[[int], Any]]] = [
    ("gpt2", gpt2, text_labels),
    ("llama", llama, text_labels),
    ("bert-classifier", bert_classifier, class_labels),
    ("t5", t5, seq2seq_labels),
]


@pytest.mark.parametrize(
    ("name", "build", "example"),
    [pytest.param(*c, id=c[0], marks=() if c[0] == "gpt2" else SLOW) for c in LOSS_CASES],
)
def test_hf_loss_inside_the_model_equals_eager_at_any_length(
    name: str, build: Callable[[], nn.Module], example: Callable[[int], Any]
) -> None:
    """``labels=``: the model's mean loss over the batch, from micro-batches of unequal
    size (5 rows in 2), equals eager's with every gradient, at the example's length and
    at two others. (Hugging Face computes its losses in float32 whatever the model's dtype,
    hence float32's tolerance.)"""
    torch.manual_seed(0)
    model = build().double()
    reference = copy.deepcopy(model)
    args, kwargs = example(LENGTH)
    pipe = fxpipe.pipeline(model, args, ["cpu"] * 2, example_kwargs=kwargs, chunks=2)
    for length in (LENGTH, LENGTH + 5, LENGTH - 4):
        args, kwargs = example(length)
        got, want = pipe(*args, **kwargs), reference(*args, **kwargs)
        assert relative_error(got.loss, want.loss) < 1e-6, length
        assert relative_error(got.logits, want.logits) < 1e-10, length
        got.loss.backward()
        want.loss.backward()
        grads = dict(reference.named_parameters())
        for path, p in model.named_parameters():
            want_grad = grads[path].grad
            assert (p.grad is None) == (want_grad is None), path
            if want_grad is not None:  # a key bias: rounding noise on both sides
                diff = (p.grad - want_grad).norm().item()
                assert diff <= 1e-5 * want_grad.norm().item() + 1e-9, path
        model.zero_grad()
        reference.zero_grad()
    assert len(pipe.variants) == 1  # one trace serves every length


def test_hf_loss_refused_where_it_is_not_exact_names_the_models_output() -> None:
    """A reduction fxpipe cannot compute from micro-batches is refused naming the model's
    own name for the output ('loss'), and the model is left as it was."""

    class MedianLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = gpt2()

        def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.net(input_ids).logits
            return {"logits": logits, "loss": logits.logsumexp(-1).median()}

    model = MedianLoss()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH))
    with pytest.raises(PlanError, match=r"output 'loss' reduces over the batch through"):
        fxpipe.pipeline(model, ids, ["cpu"] * 2)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_hf_model_with_its_cache_on_is_refused_with_the_use_cache_remedy() -> None:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, use_cache=True,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH))
    with pytest.raises(
        fxpipe.FxPipeError, match=r"remedy: the model returns a key/value cache.*use_cache=False"
    ):
        fxpipe.pipeline(model, ids, ["cpu"] * 2)
    model.config.use_cache = False
    model.eval()  # its dropout off, to compare
    pipe = fxpipe.pipeline(model, ids, ["cpu"] * 2)
    assert relative_error(pipe(ids).logits, model(ids).logits) < 1e-6


@pytest.mark.slow
def test_hf_trace_error_says_exports_reason_before_fxs() -> None:
    """fx cannot bind a decorated Hugging Face forward, so export's reason comes first, then
    fx's; here export refuses a custom autograd Function, which only fx keeps whole."""
    config = transformers.PhimoeConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
        use_cache=False,
    )  # fmt: skip
    model = transformers.PhimoeForCausalLM(config)
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH))
    with pytest.raises(fxpipe.errors.TraceError) as info:
        fxpipe.plan(model, ids, ["cpu"] * 2)
    lines = str(info.value).splitlines()
    assert lines[1].startswith("  export: RuntimeError: custom autograd Function PhimoeMultiplier")
    assert lines[2].startswith("  fx: torch.fx cannot trace PhimoeForCausalLM.forward, which a")
    assert "co_varnames is too small" in lines[2]
    assert lines[3].startswith("remedy: ") and "torch.no_grad()" in lines[3]


@pytest.mark.slow
def test_hf_collated_batch_as_example_input_is_refused_with_a_remedy_that_works() -> None:
    model = gpt2()
    batch = inputs(True)
    with pytest.raises(fxpipe.errors.InputError) as info:
        fxpipe.plan(model, batch, ["cpu"] * 2)
    message = str(info.value)
    assert "'input_ids', 'attention_mask', 'labels'" in message
    assert "example_input=(), example_kwargs=batch" in message
    plan = fxpipe.plan(model, (), ["cpu"] * 2, example_kwargs=batch)  # the remedy
    assert plan.num_stages == 2


def gpt_neo() -> nn.Module:
    config = transformers.GPTNeoConfig(
        num_layers=2, hidden_size=32, num_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
        attention_types=[[["global", "local"], 1]], window_size=4, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPTNeoForCausalLM(config)


@pytest.mark.slow
def test_hf_gpt_neo_evaluated_after_a_training_step_equals_eager() -> None:
    """GPT-Neo's attention makes its mask value in forward (a constant of the graph): the
    eval variant (traced on the model on one device, on meta on several, where it takes its
    values from the first trace) computes with it."""
    torch.manual_seed(0)
    model = gpt_neo().train()
    eager = copy.deepcopy(model)
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH))
    pipe = fxpipe.pipeline(model, ids, ["cpu"] * 2)
    got, want = pipe(ids, labels=ids), eager(ids, labels=ids)
    assert relative_error(got.logits, want.logits) < 1e-5
    assert relative_error(got.loss, want.loss) < 1e-5
    got.loss.backward()
    want.loss.backward()
    for (path, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert relative_error(p.grad, q.grad) < 1e-5, path
    for module in (model, eager):
        torch.optim.SGD(module.parameters(), lr=0.1).step()
        module.zero_grad()

    pipe.eval()
    eager.eval()
    with torch.no_grad():
        assert relative_error(pipe(ids).logits, eager(ids).logits) < 1e-5
        got, want = pipe(ids, labels=ids), eager(ids, labels=ids)
    assert relative_error(got.logits, want.logits) < 1e-5
    assert relative_error(got.loss, want.loss) < 1e-5
