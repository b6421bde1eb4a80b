"""``fxpipe.load_checkpoint``: streams a checkpoint from disk into a pipeline's stages, one
shard at a time, so that host memory stays near the largest shard, not the model.

Three layouts are read, with the keys of ``model.state_dict()``:

- one file written by ``torch.save(state_dict, path)``, opened memory-mapped (its tensors are
  read from disk as they are copied, never all at once);
- one ``.safetensors`` file (needs the ``safetensors`` package, which fxpipe does not
  depend on);
- a directory of shards with a Hugging Face-style index, ``*.index.json`` holding
  ``{"weight_map": {key: shard file}}``; the shards are ``.safetensors`` or ``torch.save``
  files. A directory with no index but one checkpoint file loads that file.

Every key and shape is checked, from the index and the shards' headers (no tensor data is
read for that), before anything is copied, so a checkpoint that does not fit changes
nothing. Each tensor is then copied into its parameter or buffer on its stage's device.
The layout follows Hugging Face's sharded checkpoints; the idea of loading shard by shard
into a model built without memory is Accelerate's (``load_checkpoint_and_dispatch``).
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from fxpipe.errors import CheckpointError, ConfigError
from fxpipe.weights.materialise import Materialised, shown

__all__ = ["load_checkpoint"]

#: File name endings read as ``torch.save`` files when a directory has no index.
TORCH_SUFFIXES = (".pt", ".pth", ".bin")

#: What a checkpoint path may be, in the remedies.
LAYOUTS = (
    "a file written by torch.save(model.state_dict(), path), a .safetensors file, or a "
    "directory of shards with a *.index.json"
)


class Loadable(Protocol):
    """What loading reads of a pipeline: the user's model and what was made on ``meta``
    (``fxpipe.Pipeline`` has both)."""

    module: torch.nn.Module

    @property
    def materialised(self) -> Materialised: ...


def load_checkpoint(pipe: Loadable, path: str | os.PathLike[str]) -> None:
    """Copy the checkpoint at ``path`` into the pipeline's parameters and buffers, in place.

    ``path`` is a ``torch.save`` file of the model's state dict, a ``.safetensors`` file, or
    a directory of shards (``.safetensors`` or ``torch.save`` files) with a Hugging
    Face-style ``*.index.json`` (``{"weight_map": {key: shard file}}``; the index file itself
    may be given too). Keys are those of ``pipe.state_dict()``; a key of a tied parameter
    may be left out when another key of it is there, and a non-persistent buffer of a model
    built on ``meta`` may be included. Shards are read one at a time, each tensor copied
    onto its stage's device, so host memory stays near the largest shard. For a model built
    under ``with torch.device("meta"):`` this is how its stages get their values.

    Raises:
        ConfigError: ``pipe`` is not an :class:`fxpipe.Pipeline`, or ``path`` not a path.
        CheckpointError: the path or a shard its index names does not exist, the safetensors
            package is missing for a ``.safetensors`` file, a file is not a state dict, or
            keys or shapes differ from the model's (all checked before anything is copied).
    """
    if not isinstance(getattr(pipe, "materialised", None), Materialised):
        raise ConfigError(
            f"pipe is a {type(pipe).__name__}, not an fxpipe.Pipeline; pass the pipeline "
            "fxpipe.pipeline() returned (a plain module loads with "
            "module.load_state_dict(torch.load(path)))"
        )
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path={path!r} is not a path; pass {LAYOUTS}")
    shards = _shards(Path(path))
    targets = _targets(pipe)
    _check_fit(Path(path), shards, targets, pipe)
    for shard in shards:
        _copy(shard, targets)
    pipe.materialised.loaded(key for shard in shards for key in shard.shapes)


def _copy(shard: _Shard, targets: Mapping[str, torch.Tensor]) -> None:
    """Copy every tensor of ``shard`` into its target; nothing of the shard is held after."""
    with torch.no_grad():
        for key, value in shard.tensors():
            targets[key].copy_(value)


class _Shard:
    """One checkpoint file and the keys to take from it (``None``: all of them). Opening it
    reads the keys and shapes only; :meth:`tensors` then yields its tensors one by one."""

    def __init__(self, file: Path, keys: list[str] | None = None) -> None:
        self.file = file
        self.safetensors = file.name.endswith(".safetensors")
        self.wanted = keys
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._state: Mapping[str, Any] | None = None

    def open(self) -> None:
        """Read the keys and shapes (a safetensors header, or a memory-mapped torch file)."""
        if self.safetensors:
            with _safe_open(self.file) as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        else:
            self._state = _torch_load(self.file)
            shapes = {k: tuple(v.shape) for k, v in self._state.items()}
        if self.wanted is not None:
            absent = [k for k in self.wanted if k not in shapes]
            if absent:
                raise CheckpointError(
                    f"shard {str(self.file)!r} lacks {shown(absent)}, which the index maps to "
                    "it; rewrite the index from the shards (or copy the right shard there)"
                )
            shapes = {k: shapes[k] for k in self.wanted}
        self.shapes = shapes

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each wanted tensor, read as it is asked for; the file is released at the end."""
        if self.safetensors:
            with _safe_open(self.file) as f:
                for key in self.shapes:
                    yield key, f.get_tensor(key)
            return
        state, self._state = self._state, None
        assert state is not None, "open() first"
        for key in self.shapes:
            yield key, state[key]
        del state  # the last reference to the mapped file: its pages leave memory


def _shards(path: Path) -> list[_Shard]:
    """The shards of the checkpoint at ``path``, each opened (keys and shapes read)."""
    if not path.exists():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist; pass {LAYOUTS}")
    if path.is_dir():
        path = _in_directory(path)
    shards = _from_index(path) if path.name.endswith(".json") else [_Shard(path)]
    for shard in shards:
        shard.open()
    return shards


def _in_directory(folder: Path) -> Path:
    """The index in ``folder`` (or, with none, its one checkpoint file)."""
    indexes = _preferred(sorted(folder.glob("*.index.json")))
    if len(indexes) == 1:
        return indexes[0]
    if indexes:
        raise CheckpointError(
            f"directory {str(folder)!r} has several indexes {[p.name for p in indexes]}; pass "
            "the path of the one to load"
        )
    files = [
        p
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name.endswith((".safetensors", *TORCH_SUFFIXES))
    ]
    files = _preferred(files)
    if len(files) == 1:
        return files[0]
    found = f"several checkpoint files {[p.name for p in files]}" if files else "none"
    raise CheckpointError(
        f"directory {str(folder)!r} has no *.index.json and {found}; pass a checkpoint file, "
        "or a directory of shards with a Hugging Face-style index "
        '({"weight_map": {key: shard file}})'
    )


def _preferred(paths: list[Path]) -> list[Path]:
    """The safetensors ones among ``paths`` when there are some and the package is
    installed (a Hugging Face directory may hold both formats), else all of them."""
    safe = [p for p in paths if ".safetensors" in p.name]
    if len(paths) > 1 and safe and _has_safetensors():
        return safe
    return paths


def _from_index(index: Path) -> list[_Shard]:
    """One shard per file the index's ``weight_map`` names, with the keys it maps there."""
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"index {str(index)!r} is not readable JSON ({e}); pass a Hugging Face-style "
            'index ({"weight_map": {key: shard file}})'
        ) from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"index {str(index)!r} has no weight_map of key -> shard file; pass a Hugging "
            'Face-style index ({"weight_map": {key: shard file}})'
        )
    by_file: dict[str, list[str]] = {}
    for key, file in weight_map.items():
        by_file.setdefault(file, []).append(key)
    absent = [f for f in by_file if not (index.parent / f).is_file()]
    if absent:
        raise CheckpointError(
            f"index {str(index)!r} names shard file(s) {shown(absent)} that are not in "
            f"{str(index.parent)!r}; put every shard beside the index (or fix its weight_map)"
        )
    return [_Shard(index.parent / file, keys) for file, keys in by_file.items()]


def _has_safetensors() -> bool:
    try:
        importlib.import_module("safetensors")
    except ImportError:
        return False
    return True


def _safe_open(file: Path) -> Any:
    """``safetensors.safe_open(file)`` for torch on the CPU."""
    try:
        safetensors = importlib.import_module("safetensors")
    except ImportError as e:
        raise CheckpointError(
            f"{str(file)!r} is a safetensors file, but the safetensors package is not "
            "installed; pip install safetensors (or load a torch.save file)"
        ) from e
    try:
        return safetensors.safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:
        raise CheckpointError(
            f"{str(file)!r} is not a readable safetensors file ({e}); pass a file written by "
            "safetensors.torch.save_file (or save_model)"
        ) from e


def _torch_load(file: Path) -> Mapping[str, torch.Tensor]:
    """The state dict in a ``torch.save`` file, memory-mapped: its keys and shapes are read,
    its tensors' data only when touched."""
    try:
        state = torch.load(file, mmap=True, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{str(file)!r} cannot be read as a torch.save file ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); pass {LAYOUTS} (torch.save's "
            "default zip format; a whole pickled model is not a state dict: save "
            "model.state_dict())"
        ) from e
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"{str(file)!r} holds a {type(state).__name__}, not a state dict; save "
            "model.state_dict() (keys as in pipe.state_dict())"
        )
    odd = [str(k) for k, v in state.items() if not (isinstance(k, str) and _is_tensor(v))]
    if odd:
        raise CheckpointError(
            f"{str(file)!r} is not a state dict of tensors: {shown(odd)} are not tensors "
            "under string keys (a checkpoint with an optimizer or extra entries?); save "
            "model.state_dict() alone"
        )
    return state


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _targets(pipe: Loadable) -> dict[str, torch.Tensor]:
    """Key -> the model's own tensor: every key of ``state_dict()`` (tied ones included),
    and the non-persistent buffers made from ``meta``."""
    model = pipe.module
    targets: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
    for key in pipe.materialised.extra_keys:
        targets[key] = model.get_buffer(key)
    return targets


def _check_fit(
    path: Path, shards: list[_Shard], targets: Mapping[str, torch.Tensor], pipe: Loadable
) -> None:
    """CheckpointError naming the missing and unexpected keys and the shapes that differ."""
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        shapes.update(shard.shapes)
    covered = {id(targets[k]) for k in shapes if k in targets}
    persistent = pipe.module.state_dict(keep_vars=True)
    missing = [k for k, t in persistent.items() if id(t) not in covered]
    unexpected = [k for k in shapes if k not in targets]
    wrong = [
        f"{k!r} {shapes[k]} in the checkpoint, {tuple(targets[k].shape)} in the model"
        for k in shapes
        if k in targets and shapes[k] != tuple(targets[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"it lacks {shown(missing)}")
    if unexpected:
        problems.append(f"it has keys the model does not: {shown(unexpected)}")
    if wrong:
        more = f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""
        problems.append(f"shapes differ: {'; '.join(wrong[:5])}{more}")
    if problems:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit the model: {'; '.join(problems)}; load a "
            "checkpoint saved from this model (keys as in pipe.state_dict()); nothing was "
            "copied"
        )
