"""A stage cut over two gloo ranks by ``parallelize_stage`` from its found plan: the outputs and
every parameter's gradient (gathered whole) equal eager PyTorch's on the same model and
input, in float64, for the hand-written decoder LM with a tied head and a fused q, k, v,
transformers' GPT-2 (Conv1D, fused q, k, v, tied head) and Llama (grouped-query attention,
a padding row), and a model whose head count tp does not divide (its attention whole on
every rank, and said); and what it refuses."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import logits_of

from fxpipe.errors import ConfigError
from fxpipe.passes.tensor.parallelize import parallelize_stage
from fxpipe.passes.tensor.plan import tensor_plan
from fxpipe.trace.tracing import trace
from tests.distributed.ranks import launch, preload, results
from tests.passes.tensor.test_plan import MODELS, VOCAB, planned

pytest.importorskip("transformers")

preload(__name__)

SLOW = pytest.mark.slow


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _cut_stage(
    rank: int, world: int, *, name: str, sequence: Any = "auto", length: int = 8
) -> dict[str, Any]:
    """Model ``name`` in float64 traced, planned over the ranks (values cut along the
    sequence as ``sequence`` says) and parallelized; its logits and gradients (cut ones
    gathered whole) next to the eager model's, on ``length`` tokens."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MODELS[name]().double()
        ids = torch.randint(0, VOCAB, (2, length))
    ids[:, 0] = torch.tensor([0, VOCAB // 2])  # row 0 of each rank's half of the vocabulary
    reference = copy.deepcopy(model)
    traced = trace(model, (ids,))
    gm, example = traced.graph_module, tuple(traced.example_values)
    plan = tensor_plan(gm, world, example, sequence_parallel=sequence)
    said = _Said()
    logging.getLogger("fxpipe").addHandler(said)
    logging.getLogger("fxpipe").setLevel(logging.INFO)
    stage = parallelize_stage(gm, plan, init_device_mesh("cpu", (world,)))
    got, want = logits_of(stage(*example)), logits_of(reference(ids))
    weights = torch.linspace(-1.0, 1.0, want.numel(), dtype=torch.float64).reshape(want.shape)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    expected = dict(reference.named_parameters(remove_duplicate=False))
    grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    placements: dict[str, str] = {}
    misplaced: list[str] = []
    for key, param in stage.named_parameters():
        assert param.grad is not None, key
        grad = param.grad
        if isinstance(param, DTensor):
            placements[key] = repr(param.placements[0])
            assert isinstance(grad, DTensor)
            if grad.placements != param.placements:  # an optimizer steps on the local pieces
                misplaced.append(f"{key}: {grad.placements} != {param.placements}")
            grad = grad.full_tensor()
        grads[key] = (grad, expected[key].grad)  # type: ignore[assignment]
    modules = {path: type(m).__name__ for path, m in stage.named_modules()}
    holders = [
        path
        for path, m in stage.named_modules(remove_duplicate=False)
        if any(p is _first_dtensor(stage) for p in m.parameters(recurse=False))
    ]
    return {
        "logits": (got.detach(), want.detach()),
        "grads": grads,
        "placements": placements,
        "misplaced": misplaced,
        "modules": modules,
        "tied": holders,
        "said": said.lines,
        "replicated": dict(plan.replicated),
        "sequence": len(plan.sequence),
        "untouched": all(not isinstance(p, DTensor) for p in gm.parameters()),
    }


def _first_dtensor(stage: torch.nn.Module) -> Any:
    from torch.distributed.tensor import DTensor

    return next(p for p in stage.parameters() if isinstance(p, DTensor))


def _run(name: str, tmp_path: Path, **options: Any) -> list[dict[str, Any]]:
    runs = results(launch(_cut_stage, 2, tmp_path, name=name, **options))
    for res in runs:
        assert res["untouched"], "the traced graph's own parameters were cut"
        assert not res["misplaced"]  # each gradient placed as its Parameter
        got, want = res["logits"]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for key, (grad, eager) in res["grads"].items():
            torch.testing.assert_close(grad, eager, rtol=1e-9, atol=1e-12, msg=key)
    return runs


def test_the_toy_decoder_with_a_tied_head_and_fused_qkv_equals_eager(tmp_path: Path) -> None:
    res = _run("toy", tmp_path)[0]
    places = res["placements"]
    assert places["tok.weight"] == "Shard(dim=0)"  # one DTensor: the embedding and the head
    assert places["blocks.0.attn.qkv.weight"] == "_StridedShard(dim=0, sf=3)"
    assert places["blocks.0.attn.proj.weight"] == "Shard(dim=1)"
    assert places["blocks.1.mlp.fc2.bias"] == "Replicate()"  # added once after the all-reduce
    assert "ln_f.weight" not in places and "pos.weight" not in places  # whole, plain tensors
    assert len(places) == 1 + 2 * 8
    assert res["tied"] == ["tok", "linear"]  # the lookup and the LM head hold one Parameter
    assert res["modules"]["tok"] == "CutEmbedding"
    assert res["modules"]["linear"] == "CutLinear"


def test_the_tied_gradient_is_the_sum_of_the_lookup_and_the_head() -> None:
    """What the toy's test relies on: untied, each use has a gradient of its own, and the
    tied one is their sum (a program that lost either use would differ)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MODELS["toy"]().double()
    untied = copy.deepcopy(model)
    untied.head.weight = torch.nn.Parameter(untied.tok.weight.detach().clone())
    ids = torch.randint(0, VOCAB, (2, 8))
    for m in (model, untied):
        m(ids).square().sum().backward()
    lookup, head = untied.tok.weight.grad, untied.head.weight.grad
    assert lookup is not None and head is not None
    assert lookup.abs().max() > 1e-3 and head.abs().max() > 1e-3
    torch.testing.assert_close(model.tok.weight.grad, lookup + head)


@SLOW
def test_gpt2_conv1d_fused_qkv_and_tied_head_equal_eager(tmp_path: Path) -> None:
    res = _run("gpt2", tmp_path)[0]
    places = res["placements"]
    assert places["transformer.h.0.attn.c_attn.weight"] == "_StridedShard(dim=1, sf=3)"
    assert places["transformer.h.0.mlp.c_fc.weight"] == "Shard(dim=1)"  # (in, out): dim 1
    assert places["transformer.h.0.mlp.c_proj.weight"] == "Shard(dim=0)"
    assert places["lm_head.weight"] == "Shard(dim=0)"
    assert res["modules"]["transformer.h.0.mlp.c_fc"] == "CutInOut"


@SLOW
def test_llama_equals_eager(tmp_path: Path) -> None:
    res = _run("llama", tmp_path)[0]
    places = res["placements"]
    assert places["model.layers.0.self_attn.k_proj.weight"] == "Shard(dim=0)"
    assert places["model.layers.1.mlp.down_proj.weight"] == "Shard(dim=1)"
    assert places["model.embed_tokens.weight"] == "Shard(dim=0)"
    assert len(places) == 2 * 7 + 2


def test_a_head_count_tp_does_not_divide_runs_its_attention_whole_and_says_so(
    tmp_path: Path,
) -> None:
    res = _run("odd_heads", tmp_path)[0]
    places = res["placements"]
    assert "blocks.0.attn.qkv.weight" not in places  # whole on every rank
    assert places["blocks.0.mlp.fc1.weight"] == "Shard(dim=0)"
    assert res["modules"]["blocks.0.attn.qkv"] == "Linear"  # the model's own, not cut
    assert set(res["replicated"]) == {
        f"blocks_{k}_attn_{name}" for k in (0, 1) for name in ("qkv", "proj")
    }
    said = [line for line in res["said"] if "blocks_0_attn_qkv runs whole" in line]
    assert len(said) == 1 and "does not divide by tp=2" in said[0], res["said"]


@pytest.mark.parametrize(
    ("name", "placed"),
    [
        ("phi3_mha", {"model.layers.0.self_attn.qkv_proj.weight": "_StridedShard(dim=0, sf=3)"}),
        ("qwen3", {"model.layers.0.self_attn.q_proj.weight": "Shard(dim=0)"}),
    ],
)
def test_fused_parts_sliced_apart_and_per_head_norms_equal_eager(
    tmp_path: Path, name: str, placed: dict[str, str]
) -> None:
    """Phi-3's q, k and v sliced off one product (cut in three parts, each slice taking its
    rank's piece of its part), and Qwen3's per-head q and k norms (their weights' gradients
    summed over the ranks): outputs and every gradient equal eager's."""
    res = _run(name, tmp_path, length=7)[0]
    for key, placement in placed.items():
        assert res["placements"][key] == placement


@pytest.mark.parametrize(
    ("name", "sequence", "length"),
    [("llama", "auto", 7), ("toy", "auto", 5), ("gpt2", "auto", 7), ("odd_heads", True, 8),
     ("toy", False, 8)],
)  # fmt: skip
def test_values_cut_along_the_sequence_equal_eager(
    tmp_path: Path, name: str, sequence: Any, length: int
) -> None:
    """Norms, adds and dropouts on each rank's share of the tokens (an odd count: shares of
    4 and 3, of 3 and 2), where it pays (GPT-2's Conv1D products reading the tokens
    unflattened), where it is forced (a whole attention), and with none: outputs and every
    gradient equal eager's."""
    res = _run(name, tmp_path, sequence=sequence, length=length)[0]
    assert (res["sequence"] > 0) == (sequence is not False)


# ------------------------------------------------------------------------------ refusals


class _Mesh:
    """A stand-in for a DeviceMesh: only its dimensions and size are read before refusing."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.ndim, self.mesh_dim_names = len(sizes), tuple(f"d{k}" for k in range(len(sizes)))
        self._size = int(torch.tensor(sizes).prod())

    def size(self) -> int:
        return self._size


def test_a_mesh_of_another_size_or_shape_is_refused_before_anything_is_cut() -> None:
    p = planned("toy")
    with pytest.raises(ConfigError, match=r"tp=2 ranks but tp_mesh has 4; plan again"):
        parallelize_stage(p.gm, p.plan, _Mesh((4,)))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"tp_mesh has 2 dimensions.*mesh\[\"tp\"\]"):
        parallelize_stage(p.gm, p.plan, _Mesh((2, 2)))  # type: ignore[arg-type]
