"""Giant-model features on Hugging Face transformers, code fxpipe's authors did not write
(small configs, no download): a model built on ``meta`` is pipelined (its tensors made on
the stages' CPU), filled from the checkpoint its eager twin wrote, by Hugging Face's own
``save_pretrained`` (sharded safetensors with an index) or by ``torch.save``, and then
equals the eager model in its outputs and every parameter's gradient, tied weights still
tied; a call before loading is refused. Memory budgets: a budget the default split exceeds
gets a split that fits (and still equals eager); one no split fits is refused, the model
left as it was."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SLOW
from oracle import relative_error
from test_hf import VOCAB, bert, gpt2, images, llama, t5, text, text_to_text, vit
from torch import nn

import fxpipe
from fxpipe.errors import CheckpointError, FxPipeError, MemoryPlanError, UninitialisedError

# In the ``test`` extra (test_hf.py, imported above, skips this module where it is missing).
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNKS = 2
#: Small enough that every model here is written as several shards with an index.
SHARD = "20KB"

Build = Callable[[], nn.Module]
Example = Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]


def opt() -> nn.Module:
    config = transformers.OPTConfig(
        num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4,
        word_embed_proj_dim=32, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
        dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model: nn.Module = transformers.OPTForCausalLM(config)
    return model


def mistral() -> nn.Module:
    config = transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
        sliding_window=4, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model: nn.Module = transformers.MistralForCausalLM(config)
    return model


#: name -> (model, example, stages).
MODELS: dict[str, tuple[Build, Example, int]] = {
    "gpt2": (gpt2, text, 3),  # LM head tied to the token embedding
    "llama": (llama, text, 2),  # tied too (test_hf's config); rotary tables non-persistent
    "bert": (bert, text, 3),  # non-persistent position_ids and token_type_ids
    "t5": (t5, text_to_text, 3),  # encoder-decoder, shared embedding
    "opt": (opt, text, 2),
    "mistral": (mistral, text, 2),  # sliding-window attention
    "vit": (vit, images, 2),
}


def _eager(name: str) -> nn.Module:
    """The model with fixed weights (seed 0), in eval mode (no dropout)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MODELS[name][0]().eval()


def _on_meta(name: str) -> nn.Module:
    with torch.device("meta"):
        model = MODELS[name][0]()
    return model.eval()


def _example(name: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return MODELS[name][1]()


def _pipe(model: nn.Module, name: str, **kwargs: Any) -> fxpipe.Pipeline:
    args, kw = _example(name)
    devices = ["cpu"] * MODELS[name][2]
    return fxpipe.pipeline(model, args, devices, example_kwargs=kw, chunks=CHUNKS, **kwargs)


def _non_persistent(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``state_dict()`` leaves out (so no checkpoint holds them)."""
    persistent = model.state_dict()
    return {k: b for k, b in model.named_buffers() if k not in persistent}


def _save_pretrained(model: Any, folder: Path, *, own_keys: bool = False) -> Path:
    """Hugging Face's own sharded safetensors checkpoint of ``model`` (several shards and a
    ``model.safetensors.index.json``); returns the folder. ``own_keys``: under the module's
    key names where transformers (5 and later) would write some models' original ones."""
    kwargs: dict[str, Any] = {}
    if own_keys and "save_original_format" in inspect.signature(model.save_pretrained).parameters:
        kwargs["save_original_format"] = False
    model.save_pretrained(folder, max_shard_size=SHARD, **kwargs)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "one shard: the index is not exercised"
    return folder


def _write(layout: str, model: Any, folder: Path) -> Path:
    """``model``'s checkpoint in ``layout``; returns the path to load."""
    if layout == "hf":
        return _save_pretrained(model, folder)
    if layout == "hf_file":  # unsharded: the directory's one model.safetensors is found
        model.save_pretrained(folder)
        assert not list(folder.glob("*.index.json"))
        return folder
    assert layout == "torch"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), folder / "model.pt")
    return folder / "model.pt"


def _fill_non_persistent(pipe: fxpipe.Pipeline, eager: nn.Module) -> None:
    """Write the buffers no checkpoint holds in place, from the eager model (the remedy the
    UninitialisedError names)."""
    with torch.no_grad():
        for key, value in _non_persistent(eager).items():
            pipe.module.get_buffer(key).copy_(value)


def _assert_tied(model: Any) -> None:
    """The tied weights of a Hugging Face model are still one Parameter (not on meta)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert head is not None and embedding is not None
    assert head.weight is embedding.weight
    assert head.weight.device.type == "cpu"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s bytes (compared with torch.equal, NaN equals itself)."""
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _grad_error(got: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    """Relative error of a gradient; where the eager gradient is zero in exact arithmetic
    (a key bias: softmax ignores a shift shared by a query's scores), both are rounding
    noise, so the error is taken against ``scale`` (a typical gradient's norm) instead."""
    if want.norm().item() > 1e-3 * scale:
        return relative_error(got, want)
    return float((got.double() - want.double()).norm().item()) / scale


def _assert_equals_eager(pipe: fxpipe.Pipeline, eager: nn.Module, name: str) -> None:
    """Values, outputs and every parameter's gradient of ``pipe`` equal ``eager``'s."""
    model = pipe.module
    mine = dict(model.named_parameters())
    theirs = dict(eager.named_parameters())
    assert list(mine) == list(theirs)  # the same Parameters, tied ones once
    loaded = model.state_dict()
    for key, value in eager.state_dict().items():  # the same values exactly
        assert torch.equal(loaded[key], value), key

    args, kwargs = _example(name)
    pipe.eval()
    want = eager(*args, **kwargs)
    got = pipe(*args, **kwargs)
    assert type(got) is type(want) and list(got.keys()) == list(want.keys())
    for key in want.keys():
        assert relative_error(got[key], want[key]) < 1e-5, key

    generator = torch.Generator().manual_seed(2)
    weights = {k: torch.randn(v.shape, generator=generator) for k, v in want.items()}
    sum((want[k] * w).sum() for k, w in weights.items()).backward()
    sum((got[k] * w).sum() for k, w in weights.items()).backward()
    norms = [p.grad.norm().item() for p in theirs.values() if p.grad is not None]
    scale = sum(norms) / len(norms)
    for key, p in theirs.items():
        got_grad, want_grad = mine[key].grad, p.grad
        assert got_grad is not None and want_grad is not None, key
        assert _grad_error(got_grad, want_grad, scale) < 1e-5, key


# ------------------------------------------------------------------ meta, then a checkpoint

#: (model, layout): "hf" is save_pretrained's sharded safetensors directory, "hf_file" its
#: directory with one unsharded file, "torch" one torch.save file of state_dict(). GPT-2's
#: sharded directory is the tied-head test's below (in the quick subset).
LOADS = [
    ("gpt2", "torch"),
    ("llama", "hf"),
    ("bert", "hf"),
    ("t5", "hf"),
    ("opt", "hf_file"),
    ("mistral", "hf"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "layout"), [pytest.param(*c, id="-".join(c)) for c in LOADS])
def test_a_meta_model_loaded_from_its_checkpoint_equals_eager(
    name: str, layout: str, tmp_path: Path
) -> None:
    """Made in place on the stages, loaded (the non-persistent buffers written in place, as
    the UninitialisedError says), tied weights still tied: as eager, to the gradients."""
    eager = _eager(name)
    path = _write(layout, eager, tmp_path / layout)
    model = _on_meta(name)
    objects = {k: id(p) for k, p in model.named_parameters()}
    pipe = _pipe(model, name)
    assert pipe.module is model and pipe.plan.num_stages == MODELS[name][2]
    assert {k: id(p) for k, p in model.named_parameters()} == objects  # made in place
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    fxpipe.load_checkpoint(pipe, path)
    _fill_non_persistent(pipe, eager)
    if name in ("gpt2", "llama"):
        _assert_tied(model)
    _assert_equals_eager(pipe, eager, name)


@pytest.mark.slow
def test_load_state_dict_with_the_non_persistent_buffers_equals_eager() -> None:
    """``pipe.load_state_dict`` takes BERT's non-persistent buffers beside its state dict."""
    eager = _eager("bert")
    pipe = _pipe(_on_meta("bert"), "bert")
    assert "embeddings.position_ids" in _non_persistent(eager)
    pipe.load_state_dict({**eager.state_dict(), **_non_persistent(eager)})
    _assert_equals_eager(pipe, eager, "bert")


def test_gpt2s_head_stays_tied_through_loading_and_gets_the_summed_gradient(
    tmp_path: Path,
) -> None:
    """GPT-2 on meta, made in place on 3 CPU stages, loaded from save_pretrained's sharded
    directory, which leaves the tied ``lm_head.weight`` out: loading the embedding fills the
    head too, it stays the embedding's Parameter, held by one stage, and its gradient (the
    head's and the embedding's, summed) equals eager's, as do the outputs and the rest."""
    eager: Any = _eager("gpt2")
    folder = _save_pretrained(eager, tmp_path / "hf")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert "transformer.wte.weight" in index["weight_map"]
    assert "lm_head.weight" not in index["weight_map"]
    model: Any = _on_meta("gpt2")
    objects = {k: id(p) for k, p in model.named_parameters()}
    pipe = _pipe(model, "gpt2")
    assert pipe.plan.num_stages == 3
    assert {k: id(p) for k, p in model.named_parameters()} == objects  # made in place
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    tied = model.transformer.wte.weight
    assert model.lm_head.weight is tied
    holders = [j for j, gm in enumerate(pipe.stages) if any(p is tied for p in gm.parameters())]
    assert len(holders) == 1
    fxpipe.load_checkpoint(pipe, folder)
    assert model.lm_head.weight is tied and torch.equal(tied, eager.lm_head.weight)
    _assert_equals_eager(pipe, eager, "gpt2")
    assert eager.lm_head.weight.grad is not None and tied.grad is not None
    assert relative_error(tied.grad, eager.lm_head.weight.grad) < 1e-5


def test_a_call_before_loading_is_refused_naming_what_is_missing(tmp_path: Path) -> None:
    """Llama on meta: refused before anything is loaded, and after its checkpoint is
    loaded still refused for the rotary tables (non-persistent: no checkpoint holds them),
    with the remedy; written in place, it equals eager."""
    eager = _eager("llama")
    folder = _save_pretrained(eager, tmp_path / "hf")
    pipe = _pipe(_on_meta("llama"), "llama")
    args, kwargs = _example("llama")
    with pytest.raises(UninitialisedError, match=r"'model\.embed_tokens\.weight'") as info:
        pipe(*args, **kwargs)
    assert isinstance(info.value, FxPipeError)
    assert "fxpipe.load_checkpoint(pipe, path)" in str(info.value)
    fxpipe.load_checkpoint(pipe, folder)
    rotary = r"'model\.rotary_emb\.inv_freq'.*non-persistent buffers"
    with pytest.raises(UninitialisedError, match=rotary) as info:
        pipe(*args, **kwargs)
    assert "model.embed_tokens.weight" not in str(info.value)  # loaded
    assert "get_buffer(name).copy_(value)" in str(info.value)  # the remedy used below
    _fill_non_persistent(pipe, eager)
    _assert_equals_eager(pipe, eager, "llama")


@pytest.mark.slow
def test_a_model_made_under_accelerates_init_empty_weights_loads_and_equals_eager(
    tmp_path: Path,
) -> None:
    """Accelerate's ``init_empty_weights()`` leaves the parameters on meta and the buffers
    real (Llama's rotary tables computed): after the checkpoint nothing is pending. It also
    unties the head (the tying assignment registers a new meta Parameter), which
    ``from_pretrained`` ties again after loading; so does this test, before pipelining."""
    accelerate = pytest.importorskip("accelerate")
    eager = _eager("llama")
    folder = _save_pretrained(eager, tmp_path / "hf")
    with accelerate.init_empty_weights():
        model: Any = llama().eval()
    model.tie_weights()
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    pipe = _pipe(model, "llama")
    fxpipe.load_checkpoint(pipe, folder)
    _assert_tied(model)
    _assert_equals_eager(pipe, eager, "llama")


@pytest.mark.slow
def test_vit_in_transformers_own_key_names_loads_and_equals_eager(tmp_path: Path) -> None:
    """ViT saved with ``save_original_format=False`` (keys as in ``state_dict()``)."""
    eager = _eager("vit")
    folder = _save_pretrained(eager, tmp_path / "hf", own_keys=True)
    pipe = _pipe(_on_meta("vit"), "vit")
    fxpipe.load_checkpoint(pipe, folder)
    _assert_equals_eager(pipe, eager, "vit")


@pytest.mark.slow
def test_vit_in_its_original_key_names_is_refused_and_copies_nothing(tmp_path: Path) -> None:
    """By default transformers 5 writes ViT under its original key names
    (``encoder.layer.0.attention.attention.key``), which ``from_pretrained`` maps to the
    module's (``layers.0.attention.k_proj``); fxpipe reads keys as they are: refused before
    anything is copied, naming both sides, and the pipeline is still unloaded."""
    eager = _eager("vit")
    folder = _save_pretrained(eager, tmp_path / "hf")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    if set(index["weight_map"]) == set(eager.state_dict()):
        pytest.skip("this transformers writes ViT under its module's own key names")
    model = _on_meta("vit")
    pipe = _pipe(model, "vit")
    before = {k: _bits(t) for k, t in model.state_dict().items()}  # uninitialised: NaN too
    with pytest.raises(CheckpointError, match=r"lacks \['layers\.0\..*keys the model does not"):
        fxpipe.load_checkpoint(pipe, folder)
    after = model.state_dict()
    assert all(torch.equal(_bits(after[k]), v) for k, v in before.items())
    with pytest.raises(UninitialisedError):
        pipe(*_example("vit")[0])


# ------------------------------------------------------------------ memory budgets


@pytest.mark.slow
def test_a_cpu_budget_the_default_split_exceeds_gets_a_split_that_fits(
    tmp_path: Path,
) -> None:
    """GPT-2 over 3 CPU stages, which share the CPU's budget, given a byte less than the
    default split needs: the plan changes to a split that fits (a split's memory depends on
    it: the last stage keeps its activations, the others recompute theirs), and the
    pipeline loaded from the checkpoint still equals eager."""
    name, devices = "gpt2", ["cpu"] * 3
    args, kwargs = _example(name)
    free = fxpipe.plan(_on_meta(name), args, devices, example_kwargs=kwargs, chunks=CHUNKS)
    need = sum(s.memory_bytes for s in free.stages)
    budget = need - 1

    eager = _eager(name)
    folder = _save_pretrained(eager, tmp_path / "hf")
    pipe = _pipe(_on_meta(name), name, max_memory={"cpu": budget})
    plan = pipe.plan
    assert plan.capacities == (budget,) * 3
    assert sum(s.memory_bytes for s in plan.stages) <= budget
    assert plan.stage_of != free.stage_of and plan.bottleneck >= free.bottleneck
    fxpipe.load_checkpoint(pipe, folder)
    _assert_equals_eager(pipe, eager, name)


@pytest.mark.slow
def test_per_device_budgets_the_default_split_exceeds_give_a_plan_that_fits() -> None:
    """Planned for three GPUs (absent: planning needs none), one budget each (in every
    spelling), the default split's largest stage over it: every stage of the plan fits its
    device's budget, and planning made nothing of the model on meta."""
    name = "gpt2"
    args, kwargs = _example(name)
    devices = ["cuda:0", "cuda:1", "cuda:2"]
    model = _on_meta(name)
    free = fxpipe.plan(model, args, devices, example_kwargs=kwargs, chunks=CHUNKS)
    memory = [s.memory_bytes for s in free.stages]
    budget = (max(memory) - 1) // 1024 * 1024  # a whole number of KiB, for the string
    assert sum(memory) < 3 * budget  # room enough on the whole
    max_memory: dict[int | str | torch.device, int | str] = {
        0: budget,
        "cuda:1": f"{budget // 1024}KiB",
        torch.device("cuda", 2): budget,
    }
    plan = fxpipe.plan(
        model, args, devices, example_kwargs=kwargs, chunks=CHUNKS, max_memory=max_memory
    )
    assert plan.capacities == (budget,) * 3
    assert all(s.memory_bytes <= budget for s in plan.stages)
    assert plan.stage_of != free.stage_of
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("on", ["cpu", pytest.param("meta", marks=SLOW)])
def test_a_budget_no_split_fits_is_refused_and_the_model_kept(on: str) -> None:
    """GPT-2, eager or on meta, with too small a CPU budget: a MemoryPlanError saying what
    the stages would need, and every parameter and buffer the same object, on the same
    device, with the same value as before; the head still tied, no gradient made."""
    name = "gpt2"
    model: Any = _eager(name) if on == "cpu" else _on_meta(name)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    before = {k: (id(t), t.device, t.detach().clone()) for k, t in tensors}
    with pytest.raises(MemoryPlanError, match=r"cpu: needs ~.* GiB for stages \[0, 1, 2\]"):
        _pipe(model, name, max_memory="100KB")
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert list(after) == list(before)
    for key, (ident, device, value) in before.items():
        assert id(after[key]) == ident and after[key].device == device, key
        if on == "cpu":
            assert torch.equal(after[key], value), key
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(p.grad is None for p in model.parameters())
