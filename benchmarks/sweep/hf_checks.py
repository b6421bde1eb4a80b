"""The sweep's checks of its transformers models beyond train and eval mode: dropout on in
both modes, a loss computed inside the model from ``labels=``, other sequence lengths."""

from __future__ import annotations

import copy
import inspect
import re
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from benchmarks.harness.compare import Side, compare, compare_outputs
from benchmarks.harness.failures import first_line
from benchmarks.harness.models.hf_text import HfBuild
from benchmarks.harness.models.spec import Args, Kwargs, generator
from benchmarks.harness.oracle import backward, eager_side, loss_weights, mixes_samples, run_eager
from benchmarks.harness.prepare import fresh, has_dropout, to_double
from benchmarks.harness.rows import Row
from benchmarks.sweep.against import (
    CHUNKS,
    Subject,
    against_eager,
    against_narrow,
    all_nan,
    build_pipeline,
    eager_narrow,
    judge,
    piped_copy,
    pipeline_side,
)
from benchmarks.sweep.narrow import Wants, reference_default
from benchmarks.sweep.progress import failure, phase

__all__ = ["LENGTHS", "SEEDS", "dropout_on", "with_labels", "other_lengths"]

#: The sequence lengths a text model's pipeline, built at the example's 12, is called at.
LENGTHS = (8, 17)
_WORST = ("wrong", "crashed", "refused", "equal")
#: The seeds eager's training calls with dropout are tried at, until two give other outputs.
SEEDS = (1, 2, 3, 4, 5, 6)
#: Why the dropout check runs in float64 only.
NARROW_DROPOUT = (
    "dropout is checked in float64 only: its exactness rests on fxpipe drawing eager's masks "
    "at one seed, which float64 shows to 1e-7, and torch draws the same masks in every dtype; "
    "a narrower dtype's rounding is what the other checks measure"
)
#: What the dropout check compares, kept in its rows.
COMPARED = (
    "train: fxpipe at chunks=1, over the most stages (the model's or fewer) whose split "
    "draws random numbers in eager's order, against eager on the whole batch, each seeded "
    "alike just before the call, at two seeds where eager's outputs differ (outputs, "
    "gradients, buffers); eval: a pipeline built in train mode at chunks=4, after "
    "pipe.eval() under no_grad, against eager in eval mode, two calls alike"
)


def _hf(subject: Subject) -> HfBuild | None:
    """The subject's transformers builder; None for timm and torchvision models."""
    build = subject.spec.build
    return build if isinstance(build, HfBuild) else None


def _skipped(why: str, exc: BaseException) -> Row:
    return {"status": "skipped", "reason": f"{why}: {first_line(repr(exc))}"}


def _differ(one: Any, two: Any) -> bool:
    """Do two calls' outputs differ (over the sweep's tolerance)?"""
    return compare_outputs(one, two)[0] is not None


def _seeded_eager(model: torch.nn.Module, inputs: tuple[Args, Kwargs], seed: int) -> Side:
    """Eager in train mode on a deep copy of ``model``, on the whole batch, the generator
    seeded with ``seed`` just before the call: outputs, then gradients and buffers after
    backward."""
    oracle = copy.deepcopy(model).train()
    args, kwargs = fresh(inputs[0]), fresh(inputs[1])
    torch.manual_seed(seed)
    output = oracle(*args, **kwargs)
    return backward(oracle, output, loss_weights(output))


def _drawing_seeds(model: torch.nn.Module, inputs: tuple[Args, Kwargs]) -> tuple[int, int] | str:
    """Two of :data:`SEEDS` at which eager's training calls give different outputs (its
    dropout really draws: drop-path over a few samples may drop nothing at one seed); else
    why not: the outputs are all NaN, or every seed gives the same (no active dropout)."""
    oracle = copy.deepcopy(model).train()
    first: tuple[int, Any] | None = None
    for seed in SEEDS:
        args, kwargs = fresh(inputs[0]), fresh(inputs[1])
        torch.manual_seed(seed)
        with torch.no_grad():
            output = oracle(*args, **kwargs)
        if first is None:
            first = seed, output
            nan = all_nan(Side(output, {}, {}))
            if nan:
                return nan
        elif _differ(output, first[1]):
            return first[0], seed
    seeds = f"{SEEDS[0]}-{SEEDS[-1]}"
    return f"no active dropout: eager's training calls at seeds {seeds} give the same outputs"


def _worst_errors(errors: list[dict[str, float]]) -> dict[str, float]:
    return {
        k: max(e.get(k, 0.0) for e in errors) for k in dict.fromkeys(k for e in errors for k in e)
    }


#: Random operators, by name (aten's, torch's, a tensor method's, torch.nn.functional's).
_RANDOM = {"dropout", "native_dropout", "feature_dropout", "alpha_dropout",
           "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "bernoulli",
           "bernoulli_", "rand", "randn", "rand_like", "randn_like", "randint", "randint_like",
           "randperm", "normal", "normal_", "uniform_", "multinomial", "exponential_",
           "geometric_", "cauchy_", "log_normal_", "random_"}  # fmt: skip


def _draws(gm: torch.fx.GraphModule) -> list[str]:
    """The nodes of ``gm`` that draw random numbers, in its order: a random operator, or a
    module with a dropout-like probability above 0."""
    names = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            draws = has_dropout(gm.get_submodule(node.target))
        elif node.op in ("call_function", "call_method"):
            words = f"{getattr(node.target, '__name__', '')} {node.target}"
            draws = not _RANDOM.isdisjoint(re.split(r"[^A-Za-z0-9_]+", words))
        else:
            draws = False
        if draws:
            names.append(node.name)
    return names


def _moved_draw(pipe: Any) -> str | None:
    """Where the stages, run one after the other, draw random numbers in another order than
    the model (its traced graph, in eager's order): a node that draws, moved by the split
    ahead of one the model draws before it (an encoder-decoder's decoder embedding placed
    with the encoder's first layers); None where the order is eager's."""
    order = _draws(pipe.variants[0].traced.graph_module)
    where = {name: j for j, stage in enumerate(pipe.stages) for name in _draws(stage)}
    staged = list(where)
    expected = [name for name in order if name in where]
    if staged == expected or set(staged) != set(order):
        return None
    i = next(i for i, (a, b) in enumerate(zip(staged, expected)) if a != b)
    return (
        f"{staged[i]} (stage {where[staged[i]]}) before {expected[i]} (stage {where[expected[i]]})"
    )


def _in_eager_order(mine: Subject, row: Row) -> tuple[torch.nn.Module, Any]:
    """A copy of the model in train mode and its pipeline of one micro-batch over the most
    stages (the subject's, or fewer) whose split draws random numbers in eager's order; each
    split that does not is noted in ``row`` (``reordered``), with the stages compared."""
    for stages in range(mine.stages, 0, -1):
        single = copy.deepcopy(mine.model).train()
        pipe = build_pipeline(replace(mine, stages=stages), single, "dropout: train", chunks=1)
        moved = _moved_draw(pipe) if stages > 1 else None
        if moved is None:
            break
        row.setdefault("reordered", []).append(f"{stages} stages: {moved}")
    row["stages_compared"] = stages
    return single, pipe


def _train_half(mine: Subject) -> Row:
    """The training half of :func:`dropout_on`, exact: a pipeline of one micro-batch whose
    stages draw random numbers in eager's order (:func:`_in_eager_order`), seeded alike,
    gives eager's outputs, gradients and buffers; at two seeds where eager's outputs differ,
    each call from the model's state as built."""
    model, inputs = mine.model, mine.inputs
    try:
        phase("dropout: eager at seeds")
        seeds = _drawing_seeds(model, inputs)
        if isinstance(seeds, str):
            return {"status": "skipped", "reason": seeds}
        wants = {seed: _seeded_eager(model, inputs, seed) for seed in seeds}
    except Exception as exc:
        return _skipped("eager failed", exc)
    row: Row = {"seeds": list(seeds)}
    errors = []
    try:
        single, pipe = _in_eager_order(mine, row)
        for seed, want in wants.items():
            single.zero_grad(set_to_none=True)
            pipe.load_state_dict(model.state_dict())  # buffers as eager's copy starts them
            torch.manual_seed(seed)  # nothing draws between here and the model's first op
            got = pipeline_side(pipe, single, inputs, want, f"dropout: train at seed {seed}")
            problem, error = compare(got, want)
            errors.append(error)
            if problem is None:
                continue
            phase(f"dropout: eager again at seed {seed}")
            again, _ = compare(_seeded_eager(model, inputs, seed), want)
            if again is not None:
                why = f"eager is not deterministic at seed {seed}: {again}"
                return {**row, "status": "skipped", "reason": why}
            return {**row, "status": "wrong", "reason": f"seed {seed}: {problem}",
                    "max_err": _worst_errors(errors)}  # fmt: skip
    except Exception as exc:
        return {**row, **failure(exc)}
    return {**row, "status": "equal", "reason": "", "max_err": _worst_errors(errors)}


def _eval_half(mine: Subject) -> Row:
    """The eval half of :func:`dropout_on`: a pipeline built in train mode (4 micro-batches),
    after ``pipe.eval()`` under no_grad, against eager in eval mode, two calls alike."""
    model = mine.model
    chunks = CHUNKS if mixes_samples(mine.spec, model, False) else None
    row: Row = {"oracle": "micro-batches" if chunks else "whole batch"}
    try:
        phase("dropout: eager eval")
        want = eager_side(model, mine.inputs, False, chunks, grads=False)
    except Exception as exc:
        return {**row, **_skipped("eager failed", exc)}
    if all_nan(want):
        return {**row, "status": "skipped", "reason": all_nan(want)}
    piped = copy.deepcopy(model).train()
    args, kwargs = mine.inputs
    try:
        pipe = build_pipeline(mine, piped, "dropout: eval")
        phase("dropout: pipeline eval")
        pipe.eval()
        with torch.no_grad():
            first = pipe(*fresh(args), **fresh(kwargs))
            second = pipe(*fresh(args), **fresh(kwargs))
    except Exception as exc:
        return {**row, **failure(exc)}
    row.update(judge(mine, False, chunks, Side(first, {}, {}), want, "dropout", grads=False))
    repeat, _ = compare_outputs(second, first)
    if row["status"] == "equal" and repeat:
        return {**row, "status": "wrong", "reason": f"two eval calls differ: {repeat}"}
    return row


def dropout_on(subject: Subject) -> Row | None:
    """The model with its config's default dropout. Train mode: a pipeline of one micro-batch
    (``chunks=1``), the generator seeded just before the call, against eager seeded alike, at
    two seeds where eager's outputs differ: outputs, gradients, buffers (skipped where no
    seed changes eager's outputs: no active dropout). Eval mode: a pipeline built in train
    mode, after ``pipe.eval()`` under no_grad, against eager in eval mode, twice alike. None
    without dropout."""
    build = _hf(subject)
    if build is None:
        return None
    phase("dropout: build")
    torch.manual_seed(0)
    try:
        model, args, kwargs = build(dropout=True)
    except Exception as exc:
        return _skipped("build with dropout failed", exc)
    model = model.double()
    if not has_dropout(model):
        return None
    if subject.narrow:
        return {"status": "skipped", "reason": NARROW_DROPOUT}
    mine = replace(subject, model=model, inputs=(to_double(args), to_double(kwargs)))
    halves = {"train": _train_half(mine), "eval": _eval_half(mine)}
    row: Row = {"compared": COMPARED, **halves}
    status = next((s for s in _WORST for h in halves.values() if h["status"] == s), "skipped")
    reasons = [f"{half}{'' if result['status'] == status else ' skipped'}: {result['reason']}"
               for half, result in halves.items()
               if result["reason"] and result["status"] in (status, "skipped")]  # fmt: skip
    return {**row, "status": status, "reason": "; ".join(reasons)}


def _label_forms(subject: Subject) -> list[tuple[str, Tensor]]:
    """The labels a model may take, most specific first: the decoder's next ids, the input
    ids (padded positions -100), class ids in range(config.num_labels)."""
    args, kwargs = subject.inputs
    forms: list[tuple[str, Tensor]] = []
    decoder = kwargs.get("decoder_input_ids")
    if isinstance(decoder, Tensor):
        labels = decoder.roll(-1, dims=1)
        labels[1, -2:] = -100
        forms.append(("decoder ids", labels))
    ids = args[0] if args else kwargs.get("input_ids")
    if isinstance(ids, Tensor) and ids.dim() == 2 and not ids.is_floating_point():
        labels = ids.clone()
        mask = kwargs.get("attention_mask")
        if isinstance(mask, Tensor):
            labels[mask == 0] = -100
        forms.append(("token ids", labels))
    rows = next(x.size(0) for x in (*args, *kwargs.values()) if isinstance(x, Tensor))
    classes = int(getattr(subject.model.config, "num_labels", 2))
    forms.append(("class ids", torch.randint(0, classes, (rows,), generator=generator(5))))
    return forms


def _loss(subject: Subject, labels: Tensor, counts: Tensor | None, chunks: int | None) -> Any:
    """Eager's loss in train mode with ``labels`` (on micro-batches: joined by ``counts``)."""
    args, kwargs = subject.inputs
    oracle = copy.deepcopy(subject.model).train()
    with torch.no_grad(), reference_default(subject.spec):
        output = run_eager(oracle, args, {**kwargs, "labels": labels}, chunks, counts)
    return output.get("loss") if isinstance(output, dict) else None


def _counts(subject: Subject, labels: Tensor, whole: Tensor | None) -> tuple[str, Tensor]:
    """Per row, the labels the loss counts: those not -100, or for a loss over the next token
    those after the first; the rule whose mean over micro-batches gives eager's whole-batch
    loss ``whole`` (None: the model mixes samples, the first rule)."""
    rules = {"rows": torch.ones(labels.size(0))}
    if labels.dim() == 2:
        counted = labels != -100
        rules = {"labels not -100": counted.sum(1).double(),
                 "labels not -100 after the first": counted[:, 1:].sum(1).double()}  # fmt: skip
    if whole is None or len(rules) == 1:
        return next(iter(rules.items()))
    gaps = {k: float((_loss(subject, labels, c, CHUNKS) - whole).abs()) for k, c in rules.items()}
    best = min(gaps, key=lambda k: gaps[k])
    return best, rules[best]


def with_labels(subject: Subject) -> Row | None:
    """The train check with ``labels=`` passed, so that the loss is computed inside the model
    (eager on micro-batches joins it as a mean weighted by the labels each counts). None for
    a model whose forward takes no ``labels``."""
    build = _hf(subject)
    if build is None or "labels" not in inspect.signature(subject.model.forward).parameters:
        return None
    if subject.spec.mixes == "always":
        return {"status": "skipped", "reason": "its loss adds router losses over each micro-"
                "batch's tokens, which eager on micro-batches cannot join"}  # fmt: skip
    mixes = mixes_samples(subject.spec, subject.model, True)
    phase("labels: eager with each form")
    tried = []
    for form, labels in _label_forms(subject):
        try:
            whole = _loss(subject, labels, None, CHUNKS if mixes else None)
        except Exception as exc:
            tried.append(f"{form}: {first_line(repr(exc), 80)}")
            continue
        if isinstance(whole, Tensor):
            break
        tried.append(f"{form}: no loss")
    else:
        return {"status": "skipped", "reason": f"eager takes no labels: {'; '.join(tried)}"}
    rule, counts = _counts(subject, labels, None if mixes else whole)
    args, kwargs = subject.inputs
    mine = replace(subject, inputs=(args, {**kwargs, "labels": labels}), counts=counts)
    return {"labels": form, "counts": rule, **against_eager(mine, True, "labels")}


def _eager_at(at: Subject, chunks: int | None, label: str) -> Side | Wants | Row:
    """Eager in train mode on ``at``'s inputs (in a narrower dtype, there and in float64), or
    the row of a length it leaves nothing to judge at."""
    if at.narrow:
        return eager_narrow(at, at.inputs, True, chunks, label)
    phase(f"{label}: eager")
    try:
        want = eager_side(at.model, at.inputs, True, chunks)
    except Exception as exc:
        return _skipped("eager failed", exc)
    nan = all_nan(want)
    return {"status": "skipped", "reason": nan} if nan else want


def other_lengths(subject: Subject) -> Row | None:
    """A text model's train-mode pipeline, built on the example (length 12), called at each
    of :data:`LENGTHS` (every sequence input rebuilt, one row padded) against eager there:
    outputs, gradients, buffers. A call fxpipe refuses (the model fixes a size) is refused."""
    build = _hf(subject)
    if build is None or not build.text:
        return None
    model = subject.model
    chunks = CHUNKS if mixes_samples(subject.spec, model, True) else None
    row: Row = {"oracle": "micro-batches" if chunks else "whole batch"}
    results: dict[str, Row] = {}
    wants: dict[str, tuple[Subject, Side | Wants]] = {}
    for length in LENGTHS:
        at = replace(subject, inputs=to_double(build.inputs(length)))
        want = _eager_at(at, chunks, f"lengths: {length}")
        if isinstance(want, dict):
            results[str(length)] = want
        else:
            wants[str(length)] = at, want
    piped = piped_copy(subject).train()
    try:
        pipe = build_pipeline(subject, piped, "lengths") if wants else None
    except Exception as exc:
        return {**row, **failure(exc)}
    for size, (at, want) in wants.items():
        label = f"lengths: {size}"
        piped.zero_grad(set_to_none=True)
        try:
            if isinstance(want, Wants):
                results[size] = against_narrow(at, pipe, piped, at.inputs, want, True, chunks,
                                               label)  # fmt: skip
                continue
            got = pipeline_side(pipe, piped, at.inputs, want, label)
        except Exception as exc:
            results[size] = failure(exc)
            continue
        results[size] = judge(at, True, chunks, got, want, label)
    results = row["lengths"] = {str(n): results[str(n)] for n in LENGTHS}
    for status in _WORST:
        for size, result in results.items():
            if result["status"] == status:
                reason = f"length {size}: {result['reason']}" if result["reason"] else ""
                return {**row, "status": status, "reason": reason}
    first = next(iter(results.values()))
    return {**row, "status": "skipped", "reason": f"length {LENGTHS[0]}: {first['reason']}"}
