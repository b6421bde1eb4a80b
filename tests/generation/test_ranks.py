"""generate() one process per stage (fxpipe.distributed's pipelines, gloo on the CPU) against
model.generate on the unpipelined model: greedy and beam search token for token with left
padding and mixed prompt lengths, prompts in chunks, 1, 2 and 3 lanes over 2 and 3 ranks,
a middle process handing steps on (Mixtral's grouped experts in bfloat16, which take a branch
of their own on the CPU), a ("pp", "dp") mesh under FSDP whose replicas generate
their own prompts and a ("pp", "dp", "tp") mesh cut over tp (each stage gathered whole for
the call; a training step and a call after it equal eager's), an encoder-decoder (T5);
every rank returns the tokens; an error on the first rank is raised on every rank and
leaves the ring ready for the next call; what is not run is refused on every rank."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe.distributed as fd
from fxpipe.distributed.parallel.ownership import full_tensor
from fxpipe.errors import ConfigError
from tests.distributed.ranks import launch, preload, results
from tests.generation.test_driver import forward_forbidden, gpt2, llama, llama4, mixtral, prompts

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
preload(__name__)

MAKERS = {
    "llama": llama, "gpt2": gpt2, "llama4": llama4,
    # transformers' grouped experts in bfloat16 (its kernels in that dtype, not float64's)
    "mixtral-bf16": lambda layers: mixtral(layers=layers).to(torch.bfloat16),
}  # fmt: skip
#: The step after generating under FSDP: large enough that the tokens change.
LR = 100.0


def _job(
    rank: int, world: int, *, name: str, layers: int, lanes: tuple[int, ...], full: bool,
    mesh_shape: tuple[int, int, int] | None = None, data_parallel: str = "ddp",
) -> dict[str, Any]:  # fmt: skip
    """What this rank's pipeline generated, and what the model generates alone; ``full``:
    beam search, a refused call and one after it too. On a ``("pp", "dp", "tp")`` mesh of
    ``mesh_shape`` (with tp over 1, cut as fxpipe finds) also a training step after generating,
    its gradients next to eager's, and a call after an update."""
    torch.manual_seed(0)
    model = MAKERS[name](layers=layers).eval()
    mesh, replica = None, 0
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        names = ("pp", "dp", "tp") if mesh_shape[2] > 1 else ("pp", "dp")  # tp over 1: none
        mesh = init_device_mesh("cpu", mesh_shape[: len(names)], mesh_dim_names=names)
        replica = mesh.get_local_rank("dp")
    ids, mask = prompts(rows=6, seed=replica)  # each replica its own prompts
    want = {"greedy": model.generate(ids, attention_mask=mask, max_new_tokens=6)}
    if full:
        want["beams"] = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=3)
    twin = copy.deepcopy(model)  # before the pipeline takes the model's weights
    cut = mesh_shape is not None and mesh_shape[2] > 1
    pipe = fd.pipeline_schedule(
        model, ids, example_kwargs={"attention_mask": mask}, n_microbatches=1,
        loss_fn=_loss if mesh else None, mesh=mesh, data_parallel=data_parallel,
        tensor_parallel="auto" if cut else None,
    )  # fmt: skip
    assert cut == (pipe.tensor_plan is not None)
    got: dict[str, Any] = {}
    held = [id(t) for t in model.parameters()]  # FSDP, tp: this rank's stage's DTensors
    with forward_forbidden(model):
        for n in lanes:
            got[f"greedy, lanes={n}"] = pipe.generate(
                ids, attention_mask=mask, max_new_tokens=6, lanes=n, prefill_chunk=3
            )  # 7 prompt tokens: steps of 3 and 4 (each process told how many are written)
        if full:
            got["beams"] = pipe.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=3)
            try:  # refused at home: raised on every rank, the ring left as it was
                pipe.generate(ids, attention_mask=mask, do_sample=True, lanes=2)
            except ConfigError as e:
                got["refused"] = str(e)
            got["after, lanes=auto"] = pipe.generate(ids, attention_mask=mask, max_new_tokens=6)
    run = pipe.last_generation
    assert run is not None
    out = {"want": want, "got": got, "lanes": run.lanes, "cache": run.cache_bytes,
           "sent weights": _sent_weights(pipe),
           "model kept": [id(t) for t in model.parameters()] == held}  # fmt: skip
    if mesh is not None:  # the weights as they were: a training step still equals eager's
        out["trained"] = _trained(pipe, twin, ids, mask, mesh)
    return out


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out["logits"].flatten(0, 1), target.flatten())


def _trained(
    pipe: Any, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, mesh: Any
) -> dict[str, Any]:
    """One training step of the pipeline after generating and one of the eager model on the
    replicas' batches: the names of this rank's gradients (gathered whole) that differ;
    then both updated, what each generates."""
    twin = copy.deepcopy(model).train()  # as the pipeline was built (in eval: no dropout)
    batches = [prompts(rows=6, seed=r) for r in range(mesh.size(1))]
    losses = [_loss(twin(i, attention_mask=m), i) for i, m in batches]
    (sum(losses) / len(losses)).backward()
    pipe.step(
        *((ids,) if pipe.is_first else ()), target=ids if pipe.is_last else None,
        **({"attention_mask": mask} if pipe.is_first else {}),
    )  # fmt: skip
    pipe.sync_tied_gradients()  # the tied embedding and head: each stage's copy's part
    want = dict(twin.named_parameters())
    wrong = []
    for name, p in pipe.named_parameters():  # the same order on both replicas of a stage
        got = full_tensor(p.grad)
        if not torch.allclose(got, want[name].grad, rtol=1e-4, atol=1e-6):
            wrong.append(name)
    for params in (pipe.parameters(), twin.parameters()):
        torch.optim.SGD(params, lr=LR).step()
    kwargs = {"attention_mask": mask, "max_new_tokens": 6}
    return {"wrong": wrong, "got": pipe.generate(ids, **kwargs),
            "want": twin.eval().generate(ids, **kwargs)}  # fmt: skip


def _sent_weights(pipe: Any) -> list[str]:
    """The weights (get_attr nodes of the step's graph) among the values a process hands
    on: a tied weight's copies are each process's own, never sent."""
    generator = pipe._generator
    out = []
    for variant in generator.variants:
        weights = {n.name for n in variant.plan.graph_module.graph.nodes if n.op == "get_attr"}
        out += [name for live in generator.live(variant) for name in live if name in weights]
    return out


@pytest.mark.parametrize(
    ("name", "world", "layers", "lanes", "full", "mesh_shape"),
    [
        # Llama 4: experts, attention in chunks, a complex rotary table handed on
        ("llama4", 2, 2, (1, 2), True, None),
        # a middle process hands steps on; grouped experts in bfloat16 (their CPU branch:
        # each rank traces the others' stages on meta, given CPU storage for the trace)
        ("mixtral-bf16", 3, 3, (3,), False, None),
        # FSDP: a tied head, replicas with their own prompts, each stage gathered whole
        ("gpt2", 4, 2, (2,), False, (2, 2, 1)),
        # FSDP and tensor parallelism together: each stage's shards gathered by FSDP, then
        # what is still cut over tp gathered whole, for the call
        ("llama", 8, 2, (2,), False, (2, 2, 2)),
    ],
    ids=["llama4-2-ranks", "mixtral-bf16-3-ranks", "gpt2-2x2x1-fsdp", "llama-2x2x2-fsdp-tp"],
)
def test_every_rank_returns_the_model_own_tokens(
    tmp_path: Path, name: str, world: int, layers: int, lanes: tuple[int, ...], full: bool,
    mesh_shape: tuple[int, int, int] | None,
) -> None:  # fmt: skip
    data_parallel = "fsdp" if mesh_shape is not None and mesh_shape[1] > 1 else "ddp"
    job = {"name": name, "layers": layers, "lanes": lanes, "full": full}
    runs = results(launch(_job, world, tmp_path, **job, mesh_shape=mesh_shape,
                          data_parallel=data_parallel))  # fmt: skip
    pp = world if mesh_shape is None else mesh_shape[0]
    for rank, run in enumerate(runs):
        want, got = run["want"], run["got"]
        for key, out in got.items():
            if key == "refused":
                assert "do_sample" in out, (rank, out)
            else:
                expected = want["beams"] if key == "beams" else want["greedy"]
                assert torch.equal(out, expected), (rank, key, out, expected)
        assert len(got) == len(lanes) + (3 if full else 0), (rank, sorted(got))
        if full:  # the last call's lanes="auto": 6 rows are too few for two lanes of 4
            assert run["lanes"] == 1, run
        assert run["sent weights"] == [], (rank, run["sent weights"])
        assert run["model kept"], rank  # the model holds what it held before the calls
        assert len(run["cache"]) == pp and all(b > 0 for b in run["cache"]), run
        if mesh_shape is not None:  # the weights as they were, trained, gathered again
            trained = run["trained"]
            assert trained["wrong"] == [], (rank, trained["wrong"])
            assert torch.equal(trained["got"], trained["want"]), rank
            assert not torch.equal(trained["want"], run["want"]["greedy"]), "no update shows"


def _refused(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = llama(layers=4).eval()
    ids, mask = prompts()
    pipe = fd.pipeline_schedule(
        model, ids, example_kwargs={"attention_mask": mask}, n_microbatches=1, loss_fn=None,
        stages_per_rank=2, schedule="interleaved1f1b",
    )  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        pipe.generate(ids, attention_mask=mask, max_new_tokens=2)
    return str(caught.value)


def test_stages_per_rank_are_refused_on_every_rank_with_the_remedy(tmp_path: Path) -> None:
    for text in results(launch(_refused, 2, tmp_path)):
        assert "2 stages per rank" in text and "stages_per_rank=1" in text, text


def _seq2seq(rank: int, world: int) -> dict[str, Any]:
    """A T5's tokens generated on ``world`` ranks (greedy on 1 and 2 lanes, beam search)
    and alone."""
    from tests.generation.test_driver_seq2seq import built, source, t5, unpipelined_forbidden

    model = built(t5)
    ids, mask = source(model, rows=6)
    want = {
        "greedy": model.generate(ids, attention_mask=mask, max_new_tokens=6),
        "beams": model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2),
    }
    example = {"attention_mask": mask, "decoder_input_ids": ids[:, :3]}
    pipe = fd.pipeline_schedule(model, ids, example_kwargs=example, n_microbatches=1,
                                loss_fn=None)  # fmt: skip
    got = {}
    with unpipelined_forbidden(model):
        for n in (1, 2):
            got[f"greedy, lanes={n}"] = pipe.generate(
                ids, attention_mask=mask, max_new_tokens=6, lanes=n, sequences_per_lane=3
            )
        got["beams"] = pipe.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
    return {"want": want, "got": got, "sent weights": _sent_weights(pipe)}


def test_an_encoder_decoder_generates_its_own_tokens_on_two_ranks(tmp_path: Path) -> None:
    for rank, run in enumerate(results(launch(_seq2seq, 2, tmp_path))):
        for key, out in run["got"].items():
            expected = run["want"]["beams" if key == "beams" else "greedy"]
            assert torch.equal(out, expected), (rank, key, out, expected)
        assert len(run["got"]) == 3 and run["sent weights"] == [], (rank, run)
