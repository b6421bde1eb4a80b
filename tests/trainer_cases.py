"""The models and batches the training-tool tests (tests/interop/) train, and how a run is
compared with the eager one.

A case is a model, a batch maker and where the loss comes from (a function of the outputs
and the labels, or the model's own output); the trainer tests run over ``CASES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from oracle import relative_error
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fxpipe

transformers = pytest.importorskip("transformers")

Batch = dict[str, torch.Tensor]
ROWS = 8  # rows per batch, as built and as trained
STEPS = 4
DEVICES = ["cpu", "cpu"]
TOLERANCE = 1e-5


# ------------------------------------------------------------------------------------ cases


class Tagger(nn.Module):
    """A residual MLP over a fixed-length sequence of features, one class per position."""

    def __init__(self, width: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.drop = nn.Dropout(0.0)
        self.head = nn.Linear(width, classes)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(features))
        h = h + self.drop(torch.tanh(self.mix(self.norm(h)))) * mask.unsqueeze(-1)
        return self.head(h)


def _tagger() -> nn.Module:
    torch.manual_seed(0)
    return Tagger()


def _tagger_rows(n: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return {
        "features": torch.randn(n, 3, 6, generator=g),
        "mask": (torch.rand(n, 3, generator=g) > 0.3).float(),
        "labels": torch.randint(0, 5, (n, 3), generator=g),
    }


def _tagger_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.flatten(0, 1), labels.flatten())


VOCAB, LONGEST = 61, 14


def gpt2(dropout: float = 0.0) -> nn.Module:
    """A 2-layer GPT-2 from a config, no dropout (its random masks differ run to run), in
    float64: the attention's key bias gets a gradient that is zero in exact arithmetic, and
    AdamW scales float32's rounding noise there up to a visible step."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32, use_cache=False,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).double()


def _text_rows(n: int, seed: int) -> Batch:
    """Token sequences of 5 to 14 tokens, right-padded to 14: ``input_ids`` (0 after the
    end), ``attention_mask`` and ``labels`` (-100 after the end: not counted in the loss)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, LONGEST + 1, (n,), generator=g)
    ids = torch.randint(1, VOCAB, (n, LONGEST), generator=g)
    mask = (torch.arange(LONGEST)[None, :] < lengths[:, None]).long()
    return {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "labels": torch.where(mask.bool(), ids, -100),
    }


def padded_to_longest(rows: list[Batch]) -> Batch:
    """A data collator that pads each batch to its own longest sequence (here: cuts the
    padding every row of the batch has), so batches come in different lengths."""
    batch = torch.utils.data.default_collate(rows)
    length = int(batch["attention_mask"].sum(1).max())
    return {k: v[:, :length] for k, v in batch.items()}


@dataclass(frozen=True)
class Case:
    """A model trained from dict batches: ``rows(n, seed)`` gives ``n`` rows of every column
    (the model's inputs and ``labels``); ``loss(outputs, labels)`` is the loss, or None where
    the model takes ``labels`` and returns its loss (``outputs["loss"]``); ``collate`` makes
    a batch of rows (None: stacked as they are)."""

    name: str
    build: Callable[[], nn.Module]  # the same weights on every call
    rows: Callable[[int, int], Batch]
    loss: Callable[[Any, torch.Tensor], torch.Tensor] | None
    pipeline_kwargs: tuple[tuple[str, Any], ...] = ()
    collate: Callable[[list[Batch]], Batch] | None = None


CASES = [
    Case("tagger", _tagger, _tagger_rows, _tagger_loss),
    # A loss inside the model from labels=, batches padded to their own longest sequence,
    # and (with Trainer) num_items_in_batch: the loss is summed over the batch's tokens.
    Case("gpt2", gpt2, _text_rows, None, collate=padded_to_longest),
]


def _inputs(case: Case, batch: Batch) -> Batch:
    """What the model is called with: the batch, less the labels where the loss is outside."""
    return {k: v for k, v in batch.items() if case.loss is None or k != "labels"}


def step_loss(case: Case, model: nn.Module, batch: Batch) -> torch.Tensor:
    outputs = model(**_inputs(case, batch))
    return outputs["loss"] if case.loss is None else case.loss(outputs, batch["labels"])


def case_pipeline(case: Case, model: nn.Module) -> fxpipe.Pipeline:
    example = _inputs(case, (case.collate or _stacked)(items_of(case.rows(ROWS, seed=99))))
    return fxpipe.pipeline(
        model, (), DEVICES, chunks=2, example_kwargs=example, **dict(case.pipeline_kwargs)
    )


class Rows(Dataset[Batch]):
    """``STEPS`` batches of rows as dicts of tensors, one row per item."""

    def __init__(self, case: Case, extra: bool = False) -> None:
        self.columns = case.rows(ROWS * STEPS, seed=1)
        if extra:  # a column no model takes: Trainer must drop it
            self.columns["row_id"] = torch.arange(ROWS * STEPS)

    def __len__(self) -> int:
        return ROWS * STEPS

    def __getitem__(self, i: int) -> Batch:
        return {k: v[i] for k, v in self.columns.items()}


def items_of(columns: Batch) -> list[Batch]:
    rows = len(next(iter(columns.values())))
    return [{k: v[i] for k, v in columns.items()} for i in range(rows)]


def _stacked(rows: list[Batch]) -> Batch:
    return torch.utils.data.default_collate(rows)  # type: ignore[no-any-return]


def case_loader(case: Case) -> DataLoader[Batch]:
    return DataLoader(Rows(case), batch_size=ROWS, shuffle=False, collate_fn=case.collate)


def assert_same_run(
    case: Case,
    got: list[torch.Tensor],
    want: list[torch.Tensor],
    model: nn.Module,
    eager: nn.Module,
) -> None:
    """Equal losses, step by step, and equal parameters after the steps (by the model's
    names); most parameters moved (one the loss never reaches may stay as it was)."""
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want)):
        assert relative_error(a, b) < TOLERANCE, f"step {step}: loss {a.item()} != {b.item()}"
    start = dict(case.build().named_parameters())
    trained = dict(model.named_parameters())
    assert trained.keys() == start.keys()
    for name, want_p in eager.named_parameters():
        assert relative_error(trained[name], want_p) < TOLERANCE, name
    moved = [k for k in trained if relative_error(trained[k], start[k]) > 1e-4]
    assert len(moved) > len(trained) / 2, f"only {moved} were trained"


def twins(case: Case) -> tuple[fxpipe.Pipeline, nn.Module]:
    """A pipeline of one copy of the model, and another copy to run eagerly."""
    return case_pipeline(case, case.build()), case.build()
