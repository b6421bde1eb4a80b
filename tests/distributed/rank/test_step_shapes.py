"""fxpipe.distributed with batches whose sequence length changes from step to step, and
``scale_grads``' default, against eager PyTorch on the same global batches.

A pipeline is built from an example of length 16 and then trained for four steps of lengths
12, 17, 5 and 12 (the first step already unlike the example, the last a length seen
before), with an SGD update after every step (or every two, the gradients of the steps
between accumulated); after every step the losses, and before every update every
parameter's gradient, equal the eager model's, trained alike, on the same batches. The
losses are means (cross entropy over the tokens) and ``scale_grads`` is left at its
default. Steps the pipeline cannot take are refused on every rank.
The ranks start as in ``ranks.py`` (a fork server, a hard time limit). Also: the first rank's
check of each step's call, and a call unlike the example's refused on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import ZOO, TinyGPT
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

import fxpipe.distributed as fd
from fxpipe.compiler import compile_model
from fxpipe.distributed.rank.shapes import StageShapes, example_shapes
from fxpipe.distributed.rank.step_shapes import StepShapes
from fxpipe.errors import ConfigError, InputError
from fxpipe.options import PlanOptions
from tests.distributed.ranks import (
    BATCH,
    close,
    launch,
    preload,
    problem,
    results,
    step,
    whole,
)

preload(__name__)

ROWS, N_MB, VOCAB = 8, 4, 64
EXAMPLE, LENGTHS = 16, (12, 17, 5, 12)
LR = 0.01


# ---------------------------------------------------------------------------- problems


def _build(name: str) -> nn.Module:
    """``transformer``: TinyGPT (torch.fx; a tied embedding, buffers narrowed to the
    length); ``llama``: the zoo's Llama-style decoder (torch.export only); ``hf_llama``:
    Hugging Face's LlamaForCausalLM from a tiny config (torch.export)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if name == "transformer":
            return TinyGPT(p=0.0)
        if name == "hf_llama":
            import transformers

            config = transformers.LlamaConfig(
                num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                max_position_embeddings=32, use_cache=False, bos_token_id=0, eos_token_id=0,
                pad_token_id=0,
            )  # fmt: skip
            return transformers.LlamaForCausalLM(config)
    return ZOO[name].build()


def _batch(length: int, rows: int = ROWS) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """Token ids, a padding mask (some sequences shorter), next-token targets."""
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(0, VOCAB, (rows, length), generator=gen)
    ends = length - torch.randint(0, max(1, length // 2), (rows,), generator=gen)
    mask = (torch.arange(length)[None, :] < ends[:, None]).float()
    target = torch.randint(0, VOCAB, (rows, length), generator=gen)
    return (ids,), {"attention_mask": mask}, target


def _mean_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens (and the hidden states' mean square, where the model returns
    them)."""
    if not isinstance(out, dict):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    loss = F.cross_entropy(out["logits"].flatten(0, 1), target.flatten())
    hidden = out.get("last_hidden_state")
    return loss if hidden is None else loss + hidden.square().mean()


def _eager(name: str, lengths: tuple[int, ...], rows: int, every: int) -> list[dict[str, Any]]:
    """The eager model trained alike (an update after every ``every`` steps, the gradients
    accumulated in between): per step, its loss and gradients."""
    model = _build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for i, length in enumerate(lengths):
        args, kwargs, target = _batch(length, rows)
        loss = _mean_loss(model(*args, **kwargs), target)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        out.append({"loss": loss.item(), "grads": grads})
        if (i + 1) % every == 0:
            optimizer.step()
            optimizer.zero_grad()
    return out


# ---------------------------------------------------------------------------- rank jobs


def _mesh(world: int, dp: int) -> tuple[Any, int]:
    if dp == 1:
        return None, 0
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
    return mesh, mesh.get_local_rank("dp")


def _slice(value: Any, dp: int, replica: int) -> Any:
    return tree_map(lambda t: t.chunk(dp)[replica] if isinstance(t, torch.Tensor) else t, value)


def _train_lengths(
    rank: int,
    world: int,
    *,
    cases: list[tuple[str, str, int]],
    lengths: tuple[int, ...] = LENGTHS,
    dp: int = 1,
    every: int = 1,
    **options: Any,
) -> list[list[dict[str, Any]]]:
    """For each (model, schedule, stages per rank): a pipeline built at length EXAMPLE, then
    a step at each of ``lengths``, and an SGD update after every ``every`` steps; per
    step, this rank's loss (the mean of its micro-batches', on the last stage) and
    gradients (whole, FSDP's gathered)."""
    mesh, replica = _mesh(world, dp)
    runs = []
    for name, schedule, spr in cases:
        args, kwargs, _ = _slice(_batch(EXAMPLE, dp * ROWS), dp, replica)
        pipe = fd.pipeline_schedule(
            _build(name), args, example_kwargs=kwargs, schedule=schedule, n_microbatches=N_MB,
            loss_fn=_mean_loss, stages_per_rank=spr, mesh=mesh, **options,
        )  # fmt: skip
        optimizer = torch.optim.SGD(pipe.parameters(), lr=LR)
        steps = []
        for i, length in enumerate(lengths):
            args, kwargs, target = _slice(_batch(length, dp * ROWS), dp, replica)
            losses = step(pipe, args, kwargs, target)
            update = (i + 1) % every == 0
            if update:  # the tied copies' gradients are summed once, before the update
                pipe.sync_tied_gradients()
            own = pipe.named_parameters()
            steps.append(
                {
                    "stages": pipe.stage_indices,
                    "replica": replica,
                    "loss": float(torch.stack(losses).detach().mean()) if losses else None,
                    "grads": {k: whole(p.grad) for k, p in own if p.grad is not None}
                    if update
                    else None,
                }
            )
            if update:
                optimizer.step()
                optimizer.zero_grad()
        runs.append(steps)
    return runs


def _check_steps(
    name: str,
    per_rank: list[list[dict[str, Any]]],
    dp: int = 1,
    lengths: tuple[int, ...] = LENGTHS,
    every: int = 1,
) -> None:
    """Every step's loss (the replicas' mean) and, before each update, every gradient (the
    steps' since the last update, summed) equal eager's."""
    eager = _eager(name, lengths, dp * ROWS, every)
    for at, (want, per_step) in enumerate(zip(eager, zip(*per_rank), strict=True)):
        losses = [r["loss"] for r in per_step if r["loss"] is not None]
        assert len(losses) == dp, (at, losses)
        assert sum(losses) / dp == pytest.approx(want["loss"], rel=1e-5), f"step {at}"
        if (at + 1) % every:
            assert all(r["grads"] is None for r in per_step)
            continue
        for replica in range(dp):
            got: set[str] = set()
            for r in (r for r in per_step if r["replica"] == replica):
                for key, grad in r["grads"].items():
                    where = f"step {at} (length {lengths[at]}), {key}, stages {r['stages']}"
                    close(grad, want["grads"][key], where)
                    got.add(key)
            assert got == set(want["grads"]), f"step {at}, replica {replica}"


# ---------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_scale_grads_defaults_to_true_giving_eagers_gradients_for_a_mean_loss(
    tmp_path: Path,
) -> None:
    """torch's schedules divide the gradients by the number of micro-batches by default,
    and so does fxpipe now: with a mean-reduced loss and no ``scale_grads``, a step's
    gradients are eager's on the whole batch (they were N_MB times them before). Two steps
    accumulate before the update: each step's own gradients are divided, not the sum
    (torch divides the whole ``.grad`` at the end of a step, the earlier step's part too)."""
    cases = [("transformer", "gpipe", 1)]
    steps = dict(lengths=(EXAMPLE, EXAMPLE), every=2)
    runs = launch(_train_lengths, 2, tmp_path, cases=cases, **steps)
    _check_steps("transformer", [r[0] for r in results(runs)], **steps)


@pytest.mark.slow
def test_another_length_every_step_matches_eager_fx_traced(tmp_path: Path) -> None:
    """TinyGPT (torch.fx; its tied embedding held by both ranks) under GPipe and 1F1B, and
    over two stages per rank under interleaved 1F1B and the zero-bubble V."""
    cases = [
        ("transformer", "gpipe", 1),
        ("transformer", "1f1b", 1),
        ("transformer", "interleaved1f1b", 2),
        ("transformer", "zbvzerobubble", 2),
    ]
    runs = results(launch(_train_lengths, 2, tmp_path, cases=cases))
    for index, _ in enumerate(cases):
        _check_steps("transformer", [r[index] for r in runs])


@pytest.mark.slow
def test_another_length_every_step_matches_eager_export_traced(tmp_path: Path) -> None:
    """The zoo's Llama-style decoder (torch.export: every size of the inputs dynamic) under
    GPipe and 1F1B."""
    cases = [("llama", "gpipe", 1), ("llama", "1f1b", 1)]
    runs = results(launch(_train_lengths, 2, tmp_path, cases=cases))
    for index, _ in enumerate(cases):
        _check_steps("llama", [r[index] for r in runs])


@pytest.mark.slow
def test_another_length_every_step_matches_eager_hugging_face_llama(tmp_path: Path) -> None:
    """transformers' LlamaForCausalLM (torch.export; a padding mask turned into its 4-D
    causal mask inside) under 1F1B."""
    pytest.importorskip("transformers")
    runs = results(launch(_train_lengths, 2, tmp_path, cases=[("hf_llama", "1f1b", 1)]))
    _check_steps("hf_llama", [r[0] for r in runs])


@pytest.mark.slow
@pytest.mark.parametrize(
    "data_parallel, name, schedule, every",
    [
        ("ddp", "llama", "1f1b", 1),
        ("fsdp", "llama", "1f1b", 1),
        ("fsdp", "transformer", "zbvzerobubble", 2),
    ],
)
def test_another_length_every_step_on_two_by_two_matches_eager(
    tmp_path: Path, data_parallel: str, name: str, schedule: str, every: int
) -> None:
    """A 2 x 2 mesh: each replica's pipeline learns its own step's sizes; the replicas
    average their gradients (DDP, or FSDP's shards) over the global batch. Under ZBV, the
    gradients of two steps of other lengths accumulate before each update (re-sizing the
    stages between them keeps FSDP's sharded gradients)."""
    spr = 2 if schedule == "zbvzerobubble" else 1
    options = dict(dp=2, data_parallel=data_parallel, every=every)
    runs = results(launch(_train_lengths, 4, tmp_path, cases=[(name, schedule, spr)], **options))
    _check_steps(name, [r[0] for r in runs], dp=2, every=every)


def _refusals(rank: int, world: int) -> dict[str, Any]:
    """Steps the pipeline cannot take, each refused on every rank before anything is sent,
    then one it can: export_only (built at length 10, which it pads to 3 windows of 4) at
    a length that breaks a condition torch.export recorded (12: no padding), with a size
    its code fixed (8 features, not 16) and with a batch of other rows, then at length 11
    (padded to the same 3 windows); and another length of a model whose stage shapes were
    found on the example's values."""
    out: dict[str, Any] = {}
    x, y = _export_only_batch(10)
    model = ZOO["export_only"].build()
    pipe = fd.pipeline_schedule(model, x, n_microbatches=N_MB, loss_fn=_sum_sq, scale_grads=False)
    model.eval()  # traced in training mode: its graph would not follow
    try:
        step(pipe, (x,), {}, y)
        out["mode"] = None
    except ConfigError as e:
        out["mode"] = str(e)
    model.train()
    bad = {
        "guard": torch.randn(ROWS, 12, 16),
        "fixed": torch.randn(ROWS, 10, 8),
        "rows": torch.randn(4, 10, 16),
    }
    for what, value in bad.items():
        try:
            step(pipe, (value,), {}, y)
            out[what] = None
        except InputError as e:
            out[what] = str(e)
    x, y = _export_only_batch(11)
    losses = step(pipe, (x,), {}, y)
    out["loss"] = float(sum(losses).detach()) if losses else None
    out["grads"] = {k: p.grad.clone() for k, p in pipe.named_parameters()}
    args, kwargs, target = _batch(EXAMPLE)
    pipe = fd.pipeline_schedule(
        _build("transformer"), args, example_kwargs=kwargs, n_microbatches=N_MB,
        loss_fn=_mean_loss,
    )  # fmt: skip
    assert pipe._step_shapes is not None
    example = pipe._step_shapes.example  # as if a shape had depended on values
    pipe._step_shapes.example = StageShapes(example.metas, example.layouts, by_values=True)
    try:
        step(pipe, *_batch(LENGTHS[0]))
        out["by_values"] = None
    except ConfigError as e:
        out["by_values"] = str(e)
    step(pipe, args, kwargs, target)  # the example's sizes still run
    return out


def _export_only_batch(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of export_only's inputs (16 features) and targets."""
    gen = torch.Generator().manual_seed(length)
    return torch.randn(ROWS, length, 16, generator=gen), torch.randn(ROWS, 10, generator=gen)


def _sum_sq(out: Any, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()


@pytest.mark.slow
def test_a_step_the_pipeline_cannot_take_is_refused_on_every_rank(tmp_path: Path) -> None:
    first, second = results(launch(_refusals, 2, tmp_path, pg_timeout=20))
    guard, fixed, rows = first["guard"], first["fixed"], first["rows"]
    assert "x (2, 12, 16)" in guard and "x.size()[1] % 4 != 0" in guard, guard
    assert "traced for shape (batch, *, 16)" in fixed and "fixed dim 2" in fixed, fixed
    assert "a batch of 4 rows" in rows and "batches of 8 rows" in rows, rows
    assert "sequence length" in rows, rows
    for what in ("guard", "fixed", "rows"):  # the other rank quotes the first's error
        assert second[what].startswith("the pipeline's first rank refused"), second[what]
        assert first[what] in second[what], second[what]
    for r in (first, second):
        assert "found them on the example's own values" in r["by_values"], r["by_values"]
        assert "traced in training mode" in r["mode"] and "model.eval() first" in r["mode"]
        assert "pad every batch" in r["by_values"]
    # the step after the refusals is eager's
    model = ZOO["export_only"].build()
    x, y = _export_only_batch(11)
    loss = _sum_sq(model(x), y)
    loss.backward()
    assert first["loss"] is None and second["loss"] == pytest.approx(loss.item(), rel=1e-5)
    grads = {**first["grads"], **second["grads"]}
    assert set(grads) == {k for k, _ in model.named_parameters()}
    for key, p in model.named_parameters():
        close(grads[key], p.grad, key)


@pytest.mark.parametrize("name", ["transformer", "llama"])
def test_shapes_found_for_another_length_are_those_of_a_run_at_it(name: str) -> None:
    """The stage shapes (and input layouts) found for a step of another length, on fake
    parameters, equal those of the build's own run on the model at that length."""
    model = _build(name)
    options = PlanOptions(cost="flops", chunks=N_MB, traffic="relay", replicate_weights=True)
    args, kwargs, _ = _batch(EXAMPLE)
    compiled = compile_model(model, args, ["cpu"] * 3, options, example_kwargs=kwargs)
    program, binder = compiled.program, compiled.traced.binder

    def micro(length: int) -> tuple[Any, dict[str, Any]]:
        args, kwargs, _ = _batch(length)
        return _slice((args, kwargs), N_MB, 0)

    example = example_shapes(model, program, binder.bind(*micro(EXAMPLE)))
    cpu = torch.device("cpu")
    sizes = StepShapes(
        program, binder, example, args, kwargs, n_microbatches=N_MB, group=None, device=cpu,
        comm=cpu,
    )  # fmt: skip
    assert sizes.key == ((ROWS // N_MB, EXAMPLE), (ROWS // N_MB, EXAMPLE))
    for length in LENGTHS:
        key = sizes.check(*_batch(length)[:2])
        assert key == ((ROWS // N_MB, length), (ROWS // N_MB, length))
        found = sizes.shapes(key)
        assert sizes.shapes(key) is found  # cached
        want = example_shapes(model, program, binder.bind(*micro(length)))
        assert found.layouts == want.layouts
        for j, (got_j, want_j) in enumerate(zip(found.metas, want.metas, strict=True)):
            for a, b in zip(tree_leaves(got_j), tree_leaves(want_j), strict=True):
                assert (a.shape, a.dtype, a.requires_grad) == (
                    b.shape,
                    b.dtype,
                    b.requires_grad,
                ), j
        assert any(length in m.shape for m in tree_leaves(found.metas[1]))


def test_the_first_ranks_check_refuses_a_call_unlike_the_examples() -> None:
    """What the first rank refuses (and every rank then raises): another number of rows or
    of dims, a missing argument, a value that is no tensor where one was traced."""
    model = _build("transformer")
    options = PlanOptions(cost="flops", chunks=N_MB, traffic="relay", replicate_weights=True)
    args, kwargs, _ = _batch(EXAMPLE)
    compiled = compile_model(model, args, ["cpu"] * 2, options, example_kwargs=kwargs)
    values = compiled.traced.binder.bind(*_slice((args, kwargs), N_MB, 0))
    example = example_shapes(model, compiled.program, values)
    cpu = torch.device("cpu")
    sizes = StepShapes(
        compiled.program, compiled.traced.binder, example, args, kwargs, n_microbatches=N_MB,
        group=None, device=cpu, comm=cpu,
    )  # fmt: skip
    (ids,), mask = args, kwargs["attention_mask"]
    with pytest.raises(InputError, match=r"idx has shape \(4, 16\): a batch of 4 rows, but"):
        sizes.check((ids[:4],), {"attention_mask": mask[:4]})
    with pytest.raises(InputError, match=r"idx has shape \(8, 16, 1\) \(3 dims\)"):
        sizes.check((ids[..., None],), kwargs)
    with pytest.raises(InputError, match="attention_mask"):
        sizes.check((ids,), {})
    with pytest.raises(InputError, match="idx is a float but a tensor was traced"):
        sizes.check((3.0,), kwargs)
    with pytest.raises(InputError, match="idx is a list of 8 items"):
        sizes.check((ids.tolist(),), kwargs)
    assert sizes.check((ids[:, :3],), {"attention_mask": mask[:, :3]}) == ((2, 3), (2, 3))


class _Scaled(nn.Module):
    """A keyword argument that is not a tensor: traced as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * scale)


def _wrong_inputs(rank: int, world: int, *, what: str) -> dict[str, Any]:
    """A step, then one the first rank refuses before sending anything: on a batch twice
    the example's (torch sized every buffer from the example), or with another value of a
    non-tensor argument (the traced graph holds the example's)."""
    _, args, _, loss_fn, target = problem("mlp_residual")
    pipe = fd.pipeline_schedule(
        _Scaled(), args, example_kwargs={"scale": 2.0}, n_microbatches=N_MB, loss_fn=loss_fn
    )
    step(pipe, args, {"scale": 2.0}, target)
    if what == "batch":
        _, args, _, _, target = problem("mlp_residual", 2 * BATCH)
    step(pipe, args, {"scale": 2.0 if what == "batch" else 3.0}, target)
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("what", ["batch", "constant"])
def test_inputs_unlike_the_examples_are_refused_before_anything_is_sent(
    tmp_path: Path, what: str
) -> None:
    """Without the checks, the last rank received into a buffer of the example's size and
    aborted (SIGABRT) on a larger batch; another constant was a RuntimeError of torch's.
    The first rank refuses the step and the other raises too, quoting it (no time-out)."""
    runs = launch(_wrong_inputs, 2, tmp_path, pg_timeout=15, what=what)
    assert all(code != 0 for code, _ in runs), [code for code, _ in runs]
    first, second = (res["error"] for _, res in runs)
    assert first.startswith("InputError"), first
    assert second.startswith("InputError: the pipeline's first rank refused"), second
    if what == "batch":
        assert "argument x has shape (16, 32): a batch of 16 rows" in first, first
        assert "built for batches of 8 rows" in first, first
    else:
        assert "argument scale is 3.0 but the pipeline was traced with 2.0" in first, first
    assert first.removeprefix("InputError: ") in second, second
