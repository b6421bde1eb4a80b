"""Seq2SeqTrainer(predict_with_generate=True) evaluates a pipeline with generation through its
stages and gets the predictions it gets from the unpipelined model."""

from __future__ import annotations

import numpy as np
import pytest

import fxpipe
from tests.generation.test_driver import built, forward_forbidden, llama, prompts

transformers = pytest.importorskip("transformers")


def test_seq2seq_trainer_predicts_with_generate_through_the_stages(tmp_path: object) -> None:
    model = built(llama, layers=2)
    ids, mask = prompts(rows=4)
    rows = [{"input_ids": i, "attention_mask": m, "labels": i} for i, m in zip(ids, mask)]
    args = transformers.Seq2SeqTrainingArguments(
        str(tmp_path), predict_with_generate=True, per_device_eval_batch_size=4,
        generation_max_length=ids.shape[1] + 5, generation_num_beams=2, report_to=[],
        use_cpu=True,
    )  # fmt: skip
    want = transformers.Seq2SeqTrainer(model=model, args=args).predict(rows).predictions
    pipe = fxpipe.pipeline(model, ids, ["cpu"] * 2, example_kwargs={"attention_mask": mask})
    with forward_forbidden(model):
        got = transformers.Seq2SeqTrainer(model=pipe, args=args).predict(rows).predictions
    np.testing.assert_array_equal(got, want)
    assert pipe.last_generation is not None and pipe.last_generation.rows == 4 * 2
