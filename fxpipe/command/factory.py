"""Turns command-line strings into a model and an example input: ``package.module:function``
or ``path/to/file.py:function`` factories, ``8,3,224,224`` shapes, ``torch.randn(...)``
expressions, and device lists."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxpipe.errors import ConfigError

__all__ = ["load_factory", "build_model", "parse_shape", "eval_input", "parse_devices"]


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` names: ``package.module:function`` (importable) or
    ``path/to/file.py:function`` (a file, not necessarily in a package)."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr or re.fullmatch(r"[A-Za-z_][\w.]*", attr) is None:
        raise ConfigError(
            f"factory {spec!r} must look like package.module:function or path/to/file.py:function"
        )
    module = _load_file(where) if _is_path(where) else _import(where)
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{where!r} has no attribute {attr!r} (factory {spec!r})")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"factory {spec!r} is a {type(target).__name__}, not a callable")
    return target  # type: ignore[no-any-return]


def _is_path(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(
            f"cannot import module {name!r} ({type(e).__name__}: {e}); install it, or give a "
            "file path such as path/to/file.py:function"
        ) from e


def _load_file(where: str) -> Any:
    path = Path(where).expanduser()
    if not path.is_file():
        raise ConfigError(f"factory file {where!r} does not exist")
    name = "_fxpipe_factory_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot load {where!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    sys.path.insert(0, str(path.resolve().parent))  # its sibling imports
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ConfigError(f"running {where!r} failed ({type(e).__name__}: {e})") from e
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def build_model(spec: str) -> nn.Module:
    """Call the factory ``spec`` with no arguments; it must return an ``nn.Module``."""
    factory = load_factory(spec)
    try:
        model = factory()
    except Exception as e:
        raise ConfigError(f"calling factory {spec!r} failed ({type(e).__name__}: {e})") from e
    if not isinstance(model, nn.Module):
        raise ConfigError(f"factory {spec!r} returned a {type(model).__name__}, not an nn.Module")
    return model


def parse_shape(text: str) -> tuple[int, ...]:
    """``"8,3,224,224"`` (or ``8x3x224x224``, ``(8, 3, 224, 224)``) -> ``(8, 3, 224, 224)``."""
    body = text.strip().strip("()[]")
    parts = [p.strip() for p in re.split(r"[,x\s]+", body) if p.strip()]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(
            f"shape {text!r} does not parse: give positive integers separated by commas, "
            "batch first, such as 8,3,224,224"
        )
    return tuple(int(p) for p in parts)


def eval_input(text: str, what: str = "--input") -> Any:
    """Evaluate a small expression with only ``torch`` in scope (no builtins)."""
    try:
        return eval(text, {"__builtins__": {}, "torch": torch})  # noqa: S307 - user's own input
    except Exception as e:
        raise ConfigError(
            f"{what} {text!r} failed ({type(e).__name__}: {e}); write an expression over "
            "torch only, such as torch.randn(8, 3, 224, 224)"
        ) from e


def parse_devices(text: str | None) -> list[str]:
    """``"cuda:0,cuda:1"`` -> a list; ``None``: every GPU, else two CPU stages."""
    if text is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{k}" for k in range(count)] if count else ["cpu", "cpu"]
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if not devices:
        raise ConfigError(
            f"--devices {text!r} names no device; give e.g. cpu,cpu or cuda:0,cuda:1"
        )
    return devices
