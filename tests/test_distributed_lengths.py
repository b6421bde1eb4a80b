"""fxpipe.distributed trained for several steps with a mean-reduced loss and ``scale_grads``
left at its default, against eager PyTorch on the same batches.

A pipeline is built from an example and trained for a few steps, with an SGD update after
every one or every two (the gradients of the steps between accumulated); after every step
the losses, and before every update every parameter's gradient, equal the eager model's,
trained alike, on the same batch. The losses are means (cross entropy over the tokens).
The ranks start as in ``test_distributed.py`` (a fork server, a hard time limit).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
if str(TESTS.parent) not in sys.path:  # the ranks import this module by its package path
    sys.path.append(str(TESTS.parent))

from models import ZOO, TinyGPT  # noqa: E402
from test_distributed import _close, _launch, _results, _step, _whole  # noqa: E402

import fxpipe.distributed as fd  # noqa: E402

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
            losses = _step(pipe, args, kwargs, target)
            update = (i + 1) % every == 0
            if update:  # the tied copies' gradients are summed once, before the update
                pipe.sync_tied_gradients()
            own = pipe.named_parameters()
            steps.append(
                {
                    "stages": pipe.stage_indices,
                    "replica": replica,
                    "loss": float(torch.stack(losses).detach().mean()) if losses else None,
                    "grads": {k: _whole(p.grad) for k, p in own if p.grad is not None}
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
    for step, (want, results) in enumerate(zip(eager, zip(*per_rank), strict=True)):
        losses = [r["loss"] for r in results if r["loss"] is not None]
        assert len(losses) == dp, (step, losses)
        assert sum(losses) / dp == pytest.approx(want["loss"], rel=1e-5), f"step {step}"
        if (step + 1) % every:
            assert all(r["grads"] is None for r in results)
            continue
        for replica in range(dp):
            got: set[str] = set()
            for r in (r for r in results if r["replica"] == replica):
                for key, grad in r["grads"].items():
                    where = f"step {step} (length {lengths[step]}), {key}, stages {r['stages']}"
                    _close(grad, want["grads"][key], where)
                    got.add(key)
            assert got == set(want["grads"]), f"step {step}, replica {replica}"


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
    runs = _launch(_train_lengths, 2, tmp_path, cases=cases, **steps)
    _check_steps("transformer", [r[0] for r in _results(runs)], **steps)
