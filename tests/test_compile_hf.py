"""Compiled stages (``compile=``) on a transformers model traced by torch.export, with its
dropout on: the loss inside the model and every gradient equal to eager, at the example's
sequence length and another, in train and in eval mode."""

from __future__ import annotations

import copy

import pytest
import torch

import fxpipe

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

VOCAB, BATCH = 97, 4


def _batch(length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, length))
    mask = torch.ones(BATCH, length, dtype=torch.long)
    mask[1, length - 3 :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_compiled_gpt2_with_dropout_equals_eager_in_train_and_eval_at_two_lengths() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip  (the config's own dropout, 0.1)
    model = transformers.GPT2LMHeadModel(config).train()
    eager = copy.deepcopy(model)
    # one micro-batch: dropout draws its masks in eager's order, so train mode compares too
    pipe = fxpipe.pipeline(
        model, (), ["cpu", "cpu"], example_kwargs=_batch(12), chunks=1,
        compile={"backend": "aot_eager"},
    )  # fmt: skip
    for length in (12, 7):
        batch = _batch(length)
        for m in (model, eager):
            m.zero_grad()
        torch.manual_seed(length)
        loss = pipe(**batch).loss
        loss.backward()
        torch.manual_seed(length)
        want = eager(**batch).loss
        want.backward()
        torch.testing.assert_close(loss, want)
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    pipe.eval()
    eager.eval()
    with torch.no_grad():
        for length in (12, 9):
            batch = _batch(length)
            torch.testing.assert_close(pipe(**batch).logits, eager(**batch).logits)
    assert len(pipe.variants) == 2  # the eval graph is another trace, compiled too
    assert len(pipe.compilation) == 4
    assert all(c.compiled and c.graphs > 0 for c in pipe.compilation)
