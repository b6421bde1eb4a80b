"""Models built on ``meta``: fxpipe.pipeline makes their tensors on the stages' devices,
fxpipe.load_checkpoint (and pipe.load_state_dict) fill them from a checkpoint saved by the
eager model, in every layout, and the result equals eager; a call before loading, and every
bad checkpoint, is refused clearly and changes nothing."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from models import ZOO, Case, TinyGPT
from oracle import relative_error
from torch import nn
from torch.utils._pytree import tree_leaves

import fxpipe
from fxpipe.errors import (
    CheckpointError,
    ConfigError,
    FxPipeError,
    UninitialisedError,
)

pytestmark = pytest.mark.usefixtures("one_thread")

HAS_SAFETENSORS = importlib.util.find_spec("safetensors") is not None
needs_safetensors = pytest.mark.skipif(
    not HAS_SAFETENSORS, reason="the safetensors package is not installed"
)
BATCH = 8
CPU2 = ["cpu", "cpu"]


def _gpt() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TinyGPT(layers=1)


#: The zoo's GPT with one layer (quicker to trace): a tied LM head, a keyword mask, a
#: non-persistent buffer (``pos_ids``) and a persistent one (``causal``).
CASES = {
    "bn_dropout_buffers": ZOO["bn_dropout_buffers"],  # BatchNorm statistics, a fixed buffer
    "gpt": Case("gpt", _gpt, ZOO["transformer"].example),
}
MODELS = list(CASES)


def _on_meta(case: Case) -> nn.Module:
    with torch.device("meta"):
        return case.build()


def _pipe(model: nn.Module, case: Case, **kwargs: Any) -> fxpipe.Pipeline:
    """The model over two CPU stages in 4 micro-batches (BatchNorm needs 2 rows in each),
    built from a CPU example (not a meta one)."""
    args, kw = case.example(BATCH)
    return fxpipe.pipeline(model, args[0], CPU2, chunks=4, example_kwargs=kw, **kwargs)


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict()`` plus the non-persistent buffers (which a model built on meta needs)."""
    state = model.state_dict()
    return {**state, **{k: b for k, b in model.named_buffers() if k not in state}}


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One key per storage (safetensors refuses tied tensors): the first key of each."""
    seen: set[int] = set()
    out = {}
    for key, t in state.items():
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            out[key] = t.contiguous()
    return out


def _write_shards(state: dict[str, torch.Tensor], folder: Path, suffix: str, n: int = 3) -> Path:
    """``state`` in ``n`` shards with a Hugging Face-style index; returns the index path."""
    keys = list(state)
    weight_map = {}
    for i in range(n):
        part = {k: state[k] for k in keys[i::n]}
        name = f"model-{i + 1:05d}-of-{n:05d}{suffix}"
        if suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(part, str(folder / name))
        else:
            torch.save(part, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    index = folder / f"model{suffix}.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def _write(layout: str, state: dict[str, torch.Tensor], folder: Path) -> Path:
    """``state`` saved in ``layout``; returns the path to pass to load_checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "torch":
        torch.save(state, folder / "model.pt")
        return folder / "model.pt"
    if layout == "safetensors":
        from safetensors.torch import save_file

        save_file(_unshared(state), str(folder / "model.safetensors"))
        return folder / "model.safetensors"
    if layout == "sharded_torch":  # the directory: its one index is found
        _write_shards(state, folder, ".bin")
        return folder
    assert layout == "sharded_safetensors"  # the index file itself
    return _write_shards(_unshared(state), folder, ".safetensors")


def _assert_equals_eager(pipe: fxpipe.Pipeline, eager: nn.Module, case: Case) -> None:
    """Outputs and every parameter's gradient of ``pipe`` equal ``eager``'s (eval mode:
    BatchNorm on running statistics, no dropout; both start from the same values)."""
    args, kwargs = case.example(BATCH)
    pipe.eval()
    eager.eval()
    got, want = tree_leaves(pipe(*args, **kwargs)), tree_leaves(eager(*args, **kwargs))
    for g, w in zip(got, want, strict=True):
        assert relative_error(g, w) < 1e-5
    sum(g.float().square().mean() for g in got).backward()
    sum(w.float().square().mean() for w in want).backward()
    mine = dict(pipe.module.named_parameters())
    for name, p in eager.named_parameters():
        assert p.grad is not None and mine[name].grad is not None, name
        assert relative_error(mine[name].grad, p.grad) < 1e-5, name


# ------------------------------------------------------------------ building on meta


@pytest.mark.parametrize("name", MODELS)
def test_pipeline_makes_a_meta_models_tensors_on_the_stages_in_place(name: str) -> None:
    case = CASES[name]
    model = _on_meta(case)
    objects = {k: id(t) for k, t in [*model.named_parameters(), *model.named_buffers()]}
    if name == "gpt":  # planning alone, from a CPU example, leaves the model on meta
        args, kwargs = case.example(BATCH)
        plan = fxpipe.plan(model, args[0], CPU2, example_kwargs=kwargs)
        assert plan.num_stages == 2 and all(p.is_meta for p in model.parameters())
    pipe = _pipe(model, case)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    assert {k: id(t) for k, t in tensors} == objects  # the model's own objects, kept
    assert all(t.device.type == "cpu" for _, t in tensors)
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}
    assert all(p.requires_grad and isinstance(p, nn.Parameter) for p in model.parameters())
    held = {id(t) for gm in pipe.stages for t in [*gm.parameters(), *gm.buffers()]}
    assert held <= set(objects.values())  # the stages hold the same objects
    if name == "gpt":
        assert model.head.weight is model.tok.weight  # still tied


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("gpt", "torch"),
        pytest.param("gpt", "safetensors", marks=needs_safetensors),
        ("gpt", "sharded_torch"),
        pytest.param("gpt", "sharded_safetensors", marks=needs_safetensors),
        ("bn_dropout_buffers", "sharded_torch"),
    ],
)
def test_a_checkpoint_loaded_into_a_meta_pipeline_equals_eager(
    name: str, layout: str, tmp_path: Path
) -> None:
    case = CASES[name]
    eager = case.build()
    path = _write(layout, _full_state(eager), tmp_path / layout)
    pipe = _pipe(_on_meta(case), case)
    fxpipe.load_checkpoint(pipe, path)
    _assert_equals_eager(pipe, eager, case)


def test_load_state_dict_into_a_meta_pipeline_equals_eager() -> None:
    case = CASES["gpt"]
    eager = case.build()
    pipe = _pipe(_on_meta(case), case)
    pipe.load_state_dict(_full_state(eager))  # the non-persistent pos_ids is accepted
    _assert_equals_eager(pipe, eager, case)


def test_a_model_with_meta_parameters_and_real_buffers_loads_and_equals_eager(
    tmp_path: Path,
) -> None:
    """As Accelerate's ``init_empty_weights()`` leaves a model: parameters on meta, buffers
    real (so ``pos_ids`` keeps its value and need not be loaded)."""
    case = CASES["gpt"]
    eager = case.build()
    model = case.build()
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[key] = nn.Parameter(p.to("meta"))
    model.head.weight = model.tok.weight  # tied again
    assert not any(b.is_meta for b in model.buffers())
    pipe = _pipe(model, case)
    fxpipe.load_checkpoint(pipe, _write("torch", eager.state_dict(), tmp_path))
    _assert_equals_eager(pipe, eager, case)


def test_cost_time_on_a_meta_model_is_refused_and_the_model_stays_on_meta() -> None:
    case = CASES["bn_dropout_buffers"]
    model = _on_meta(case)
    with pytest.raises(ConfigError, match=r"cost='time'.*'meta'.*cost='auto'"):
        _pipe(model, case, cost="time")
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_a_failure_while_placing_puts_the_made_tensors_back_on_meta(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = CASES["bn_dropout_buffers"]
    model = _on_meta(case)
    objects = [id(t) for t in [*model.parameters(), *model.buffers()]]

    def fail(self: Any, devices: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr("fxpipe.weights.materialise.Materialised.finish", fail)
    with pytest.raises(RuntimeError, match="injected"):
        _pipe(model, case)
    assert [id(t) for t in [*model.parameters(), *model.buffers()]] == objects
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


# ------------------------------------------------------------------ refusing a call


def test_a_call_before_loading_is_refused_naming_the_keys_and_the_remedy() -> None:
    case = CASES["bn_dropout_buffers"]
    eager = case.build()
    pipe = _pipe(_on_meta(case), case)
    args, _ = case.example(BATCH)
    with pytest.raises(UninitialisedError) as info:
        pipe(*args)
    message = str(info.value)
    assert isinstance(info.value, FxPipeError) and isinstance(info.value, ValueError)
    assert "'bns.0.bias'" in message and "(33 in all)" in message
    assert "pipe.load_state_dict(state_dict)" in message
    assert "fxpipe.load_checkpoint(pipe, path)" in message
    # a partial load leaves the rest pending, and names them (BatchNorm's own loader sets a
    # missing num_batches_tracked to 0, as torch does: those 4 count as written)
    state = eager.state_dict()
    rest = {k: v for k, v in state.items() if not k.startswith("bns.")}
    pipe.load_state_dict(rest, strict=False)
    with pytest.raises(UninitialisedError, match=r"16 of .*'bns\.0\.bias'") as info:
        pipe(*args)
    assert "'inp.weight'" not in str(info.value)
    pipe.load_state_dict({k: v for k, v in state.items() if k.startswith("bns.")}, strict=False)
    assert not pipe.materialised.active  # nothing pending: one flag read per call from now
    _assert_equals_eager(pipe, eager, case)


def test_a_non_persistent_buffer_left_out_is_named_with_its_remedy(tmp_path: Path) -> None:
    case = CASES["gpt"]
    eager = case.build()
    pipe = _pipe(_on_meta(case), case)
    fxpipe.load_checkpoint(pipe, _write("torch", eager.state_dict(), tmp_path))
    args, kwargs = case.example(BATCH)
    with pytest.raises(UninitialisedError, match=r"\['pos_ids'\];.*non-persistent") as info:
        pipe(*args, **kwargs)
    assert "get_buffer(name).copy_(value)" in str(info.value)
    pipe.module.get_buffer("pos_ids").copy_(eager.pos_ids)  # written in place: initialised
    _assert_equals_eager(pipe, eager, case)


def test_initialising_in_place_counts_as_loaded() -> None:
    case = CASES["bn_dropout_buffers"]
    pipe = _pipe(_on_meta(case), case)
    for module in pipe.module.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    with torch.no_grad():
        pipe.module.get_buffer("scale").fill_(1.0)
    out = pipe.eval()(*case.example(BATCH)[0])
    assert out.shape == (BATCH, 6) and bool(torch.isfinite(out).all())


# ------------------------------------------------------------------ bad checkpoints


Loaded = tuple[fxpipe.Pipeline, nn.Module, Path]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    """A meta-built pipeline loaded from the eager model's checkpoint, the eager model, that
    checkpoint; shared by the tests below, each of which checks that it changed nothing."""
    case = CASES["bn_dropout_buffers"]
    eager = case.build()
    path = _write("torch", eager.state_dict(), tmp_path_factory.mktemp("good"))
    pipe = _pipe(_on_meta(case), case)
    fxpipe.load_checkpoint(pipe, path)
    return pipe, eager, path


def _corrupt(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path, Path], Path]:
    def write(good: Path, folder: Path) -> Path:
        state = dict(torch.load(good, weights_only=True))
        edit(state)
        return _write("torch", state, folder)

    return write


def _missing_shard(good: Path, folder: Path) -> Path:
    index = _write("sharded_torch", dict(torch.load(good, weights_only=True)), folder)
    (folder / "model-00002-of-00003.bin").unlink()
    return index


def _index_without_map(good: Path, folder: Path) -> Path:
    folder.mkdir()
    (folder / "model.index.json").write_text(json.dumps({"metadata": {}}))
    return folder


def _not_a_state_dict(good: Path, folder: Path) -> Path:
    folder.mkdir()
    torch.save([torch.zeros(2)], folder / "list.pt")
    return folder / "list.pt"


def _empty_directory(good: Path, folder: Path) -> Path:
    folder.mkdir()
    return folder


def _pop(key: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda state: state.pop(key) and None


BAD: dict[str, tuple[Callable[[Path, Path], Any], type[Exception], str]] = {
    "path that does not exist": (
        lambda good, folder: folder / "nowhere.pt",
        CheckpointError,
        r"'.*nowhere\.pt' does not exist; pass a file written by torch\.save",
    ),
    "missing keys": (
        _corrupt(lambda s: [s.pop(k) for k in list(s) if k.startswith("fcs.")] and None),
        CheckpointError,
        r"it lacks \['fcs\.0\.weight', 'fcs\.0\.bias', .* and 3 more \(8 in all\).*nothing was",
    ),
    "unexpected key": (
        _corrupt(lambda s: s.update(extra=torch.zeros(3))),
        CheckpointError,
        r"keys the model does not: \['extra'\]",
    ),
    "shape mismatch": (
        _corrupt(lambda s: s.update({"head.weight": torch.zeros(7, 64)})),
        CheckpointError,
        r"shapes differ: 'head\.weight' \(7, 64\) in the checkpoint, \(6, 64\) in the model",
    ),
    "index naming a missing shard": (
        _missing_shard,
        CheckpointError,
        r"names shard file\(s\) \['model-00002-of-00003\.bin'\] that are not in",
    ),
    "index without weight_map": (
        _index_without_map,
        CheckpointError,
        r"'.*model\.index\.json' has no weight_map",
    ),
    "not a state dict": (
        _not_a_state_dict,
        CheckpointError,
        r"'.*list\.pt' holds a list, not a state dict; save model\.state_dict\(\)",
    ),
    "directory without checkpoint": (
        _empty_directory,
        CheckpointError,
        r"has no \*\.index\.json and none; pass a checkpoint file",
    ),
    "path of another type": (lambda good, folder: 3, ConfigError, r"path=3 is not a path"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_a_bad_checkpoint_is_refused_and_changes_nothing(
    case: str, loaded: Loaded, tmp_path: Path
) -> None:
    pipe, _, good = loaded
    make, error, message = BAD[case]
    path = make(good, tmp_path / "bad")
    before = {k: (id(t), t.detach().clone()) for k, t in pipe.state_dict(keep_vars=True).items()}
    with pytest.raises(error, match=message) as info:
        fxpipe.load_checkpoint(pipe, path)
    assert isinstance(info.value, FxPipeError) and isinstance(info.value, ValueError)
    after = pipe.state_dict(keep_vars=True)
    for key, (ident, value) in before.items():
        assert id(after[key]) == ident and torch.equal(after[key], value), key


def test_a_bad_checkpoint_leaves_a_meta_pipeline_unloaded(tmp_path: Path) -> None:
    case = CASES["bn_dropout_buffers"]
    state = case.build().state_dict()
    state["head.weight"] = torch.zeros(7, 64)
    pipe = _pipe(_on_meta(case), case)
    with pytest.raises(CheckpointError, match="shapes differ"):
        fxpipe.load_checkpoint(pipe, _write("torch", state, tmp_path))
    with pytest.raises(UninitialisedError, match=r"\(33 in all\)"):
        pipe(*case.example(BATCH)[0])


def test_a_plain_module_is_refused_with_the_remedy(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    path = _write("torch", model.state_dict(), tmp_path)
    with pytest.raises(ConfigError, match=r"pipe is a Linear, not an fxpipe\.Pipeline"):
        fxpipe.load_checkpoint(model, path)  # type: ignore[arg-type]


@needs_safetensors
def test_a_safetensors_file_without_the_package_says_how_to_install_it(
    loaded: Loaded, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipe, eager, _ = loaded
    path = _write("safetensors", eager.state_dict(), tmp_path / "st")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors -> ImportError
    with pytest.raises(CheckpointError, match=re.escape("pip install safetensors")):
        fxpipe.load_checkpoint(pipe, path)


@needs_safetensors
def test_a_key_mapped_to_a_shard_that_lacks_it_is_named(loaded: Loaded, tmp_path: Path) -> None:
    pipe, eager, _ = loaded
    index = _write("sharded_safetensors", eager.state_dict(), tmp_path / "st")
    data = json.loads(index.read_text())
    data["weight_map"]["inp.weight"] = "model-00003-of-00003.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"lacks \['inp\.weight'\], which the index maps"):
        fxpipe.load_checkpoint(pipe, index)
