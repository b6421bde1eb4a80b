"""generate() one process per stage (fxpipe.distributed's pipelines, gloo on the CPU) against
model.generate on the unpipelined model: greedy and beam search token for token with left
padding and mixed prompt lengths, prompts in chunks, 1, 2 and 3 lanes over 2 and 3 ranks,
a middle process handing steps on, a ("pp", "dp") mesh whose replicas generate their own
prompts, an encoder-decoder (T5); every rank returns the tokens; an error on the first
rank is raised on every rank and leaves the ring ready for the next call; what is not run
is refused on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe.distributed as fd
from fxpipe.errors import ConfigError
from tests.distributed.ranks import launch, preload, results
from tests.generation.test_driver import forward_forbidden, gpt2, llama, prompts, qwen2

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
preload(__name__)

MAKERS = {"llama": llama, "gpt2": gpt2, "qwen2": qwen2}


def _job(
    rank: int, world: int, *, name: str, layers: int, lanes: tuple[int, ...], full: bool,
    dp: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """What this rank's pipeline generated, and what the model generates alone; ``full``:
    beam search, a refused call and one after it too."""
    torch.manual_seed(0)
    model = MAKERS[name](layers=layers).eval()
    mesh, replica = None, 0
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
        replica = mesh.get_local_rank("dp")
    ids, mask = prompts(rows=6, seed=replica)  # each replica its own prompts
    want = {"greedy": model.generate(ids, attention_mask=mask, max_new_tokens=6)}
    if full:
        want["beams"] = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=3)
    pipe = fd.pipeline_schedule(
        model, ids, example_kwargs={"attention_mask": mask}, n_microbatches=1, loss_fn=None,
        mesh=mesh,
    )  # fmt: skip
    got: dict[str, Any] = {}
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
    return {"want": want, "got": got, "lanes": run.lanes, "cache": run.cache_bytes,
            "sent weights": _sent_weights(pipe)}  # fmt: skip


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
    ("name", "world", "layers", "lanes", "full", "dp"),
    [
        ("llama", 2, 2, (1, 2), True, 1),
        ("qwen2", 3, 3, (3,), False, 1),  # a middle process hands steps on
        ("gpt2", 4, 2, (2,), False, 2),  # tied weights, replicas with their own prompts
    ],
    ids=["llama-2-ranks", "qwen2-3-ranks", "gpt2-2x2-mesh"],
)
def test_every_rank_returns_the_model_own_tokens(
    tmp_path: Path, name: str, world: int, layers: int, lanes: tuple[int, ...], full: bool,
    dp: int,
) -> None:  # fmt: skip
    runs = results(
        launch(_job, world, tmp_path, name=name, layers=layers, lanes=lanes, full=full, dp=dp)
    )
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
        assert len(run["cache"]) == world // dp and all(b > 0 for b in run["cache"]), run


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
