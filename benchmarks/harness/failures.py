"""An exception described for a result file: type, message, innermost fxpipe frame, with no
machine paths."""

from __future__ import annotations

import re
import traceback
from pathlib import Path
from typing import Any

from benchmarks.harness.output import ROOT

__all__ = ["scrub", "describe", "first_line"]


def _source_roots() -> list[Path]:
    """Where the fxpipe being checked lives (its checkout), then this repository."""
    import fxpipe

    return [Path(fxpipe.__file__).resolve().parent.parent, ROOT]


def _short(path: str) -> str:
    """A frame's file without machine paths: relative to the checkout or site-packages."""
    for root in _source_roots():
        try:
            return str(Path(path).resolve().relative_to(root))
        except ValueError:
            continue
    parts = Path(path).parts
    if "site-packages" in parts:
        return "/".join(parts[parts.index("site-packages") + 1 :])
    return Path(path).name


def _frame(f: traceback.FrameSummary) -> str:
    return f"{_short(f.filename)}:{f.lineno} in {f.name}"


def _is_fxpipe(f: traceback.FrameSummary) -> bool:
    return _short(f.filename).startswith(("fxpipe/", "passes/"))


def _chain(exc: BaseException) -> list[BaseException]:
    chain = [exc]
    while len(chain) < 8:
        nxt = chain[-1].__cause__ or chain[-1].__context__
        if nxt is None or nxt in chain:
            break
        chain.append(nxt)
    return chain


def scrub(text: str) -> str:
    """``text`` without machine paths: site-packages and the checkout become relative."""
    text = re.sub(r"[^\s\"'(]*/site-packages/", "", text)
    for root in _source_roots():
        text = text.replace(f"{root}/", "")
    return text


def describe(exc: BaseException) -> dict[str, Any]:
    """Type, message, innermost fxpipe frame and innermost frame of an exception (and of the
    exception at the root of its chain, when that is another one)."""
    chain = _chain(exc)
    info: dict[str, Any] = {"type": type(exc).__name__, "message": scrub(str(exc))[:3000]}
    for e in reversed(chain):
        frames = [f for f in traceback.extract_tb(e.__traceback__) if _is_fxpipe(f)]
        if frames:
            info["fxpipe_frame"] = _frame(frames[-1])
            break
    frames = traceback.extract_tb(chain[-1].__traceback__)
    if frames:
        info["frame"] = _frame(frames[-1])
    if len(chain) > 1:
        info["cause"] = f"{type(chain[-1]).__name__}: {scrub(str(chain[-1]))[:1000]}"
    return info


def first_line(text: str, limit: int = 200) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
