"""The sweep's checks: each one function of a built model, one column of the table, one entry
of a row's ``checks`` in the JSON.

A check takes the :class:`Subject` (the model built, in float64 with every dropout at zero,
its inputs, its stage count and the cost mode) and returns its result row: ``status``
(one of ``harness.rows.STATUSES``), ``reason``, and whatever it measured; or None where it
does not apply to the model (its column then shows nothing for it). To add one, write the
function (here, or in a module beside this one) and add it to :data:`CHECKS`: the worker runs
it after the others, in the model's own process, the model's class becomes the worst over
all its checks, and the table gains its column. Each check gets the model as built; one that
changes it (dropout on, another sequence length, ``labels=``) works on its own copy or
builds its own from ``subject.spec`` (``hf_checks.py``: the transformers models' three).
"""

from __future__ import annotations

from benchmarks.harness.rows import Row
from benchmarks.sweep.against import CHUNKS, Check, Subject, against_eager
from benchmarks.sweep.hf_checks import dropout_on, other_lengths, with_labels

__all__ = ["CHUNKS", "Subject", "Check", "CHECKS"]


def train_mode(subject: Subject) -> Row:
    """Train mode (BatchNorm and routing against eager on the same micro-batches)."""
    return against_eager(subject, train=True, label="train")


def eval_mode(subject: Subject) -> Row:
    """Eval mode."""
    return against_eager(subject, train=False, label="eval")


#: Every check, in the order a worker runs them; the name is the table's column and the key
#: of the row's ``checks``.
CHECKS: dict[str, Check] = {
    "train": train_mode,
    "eval": eval_mode,
    "dropout": dropout_on,
    "labels": with_labels,
    "lengths": other_lengths,
}
