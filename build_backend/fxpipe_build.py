"""fxpipe's build backend: setuptools, with an editable install that type checkers can read.

``passes/`` is installed as ``fxpipe.passes``. For a layout like that, setuptools makes an
editable install an import hook: Python follows it, static tools (mypy, pyright, editors)
do not, so to them ``import fxpipe`` finds nothing. ``build_editable`` keeps that hook and
adds a ``.pth`` file that puts a folder of symbolic links on ``sys.path``, laid out like the
installed package::

    build/__editable__.fxpipe-links/fxpipe/   a real folder
        __init__.py, api.py, ..., py.typed   links to the files in fxpipe/
        trace/, runtime/, ...                links to the folders in fxpipe/
        passes/                              a link to passes/

Edits show through at once, and so do new modules in a subpackage (their folders are
links). A new module directly in ``fxpipe/`` is imported at once (through the hook); type
checkers see it after the next ``pip install -e``. The hook also serves ``python`` started
in the repository root, where ``./fxpipe`` comes first on ``sys.path`` and has no
``passes``. Where symbolic links cannot be made, the install is setuptools' own.

Every other hook is setuptools' own; an explicit ``editable_mode`` (``pip install -e .
--config-settings editable_mode=strict``) gets setuptools' own editable install too.
"""

from __future__ import annotations

import base64
import hashlib
import locale
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any

from setuptools import build_meta
from setuptools.build_meta import (
    build_sdist,
    build_wheel,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)
from setuptools.dist import Distribution

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]


def build_editable(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    """setuptools' editable wheel, plus a ``.pth`` for the link folder (see the module)."""
    name = str(build_meta.build_editable(wheel_directory, config_settings, metadata_directory))
    settings = config_settings or {}
    if "editable_mode" in settings or "editable-mode" in settings:
        return name
    root = Path.cwd()  # PEP 517: hooks run in the project's root
    dist = Distribution()
    dist.parse_config_files()
    links = root / "build" / f"__editable__.{dist.get_name()}-links"
    try:
        _link_tree(root, links, dist.packages or [], dist.package_dir or {})
    except OSError as error:
        shutil.rmtree(links, ignore_errors=True)
        warnings.warn(f"no link folder for type checkers ({error})", stacklevel=1)
        return name
    pth = f"__editable__.{dist.get_name()}-links.pth"
    _add_to_wheel(Path(wheel_directory, name), pth, f"{links}\n")
    return name


def _source(root: Path, package: str, package_dir: dict[str, str]) -> Path:
    """The folder ``package`` is built from (setuptools' ``package_dir`` rule)."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in package_dir:
            return root.joinpath(package_dir[prefix], *parts[i:])
    return root.joinpath(package_dir.get("", ""), *parts)


def _link_tree(root: Path, links: Path, packages: list[str], package_dir: dict[str, str]) -> None:
    """Lay out ``packages`` under ``links`` with as few links as possible: a package whose
    subpackages all sit in its own folder is one link to that folder."""

    def place(package: str, dest: Path) -> None:
        source = _source(root, package, package_dir)
        inner = [p for p in packages if p.startswith(package + ".")]
        depth = package.count(".") + 1
        moved = [
            p
            for p in inner
            if _source(root, p, package_dir) != source.joinpath(*p.split(".")[depth:])
        ]
        if not moved:
            dest.symlink_to(source, target_is_directory=True)
            return
        dest.mkdir(parents=True)
        children = [p for p in inner if "." not in p[len(package) + 1 :]]
        skip = {p.rpartition(".")[2] for p in children} | {"__pycache__"}
        for entry in sorted(source.iterdir()):
            if entry.name not in skip:
                (dest / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
        for child in children:
            place(child, dest / child.rpartition(".")[2])

    shutil.rmtree(links, ignore_errors=True)
    links.mkdir(parents=True)
    for package in packages:
        if package.rpartition(".")[0] not in packages:
            place(package, links.joinpath(*package.split(".")))


def _add_to_wheel(wheel: Path, name: str, text: str) -> None:
    """Add the file ``name`` to ``wheel`` (first, so dist-info stays last) and to its RECORD.
    ``.pth`` files are read in the locale's encoding."""
    data = text.encode(locale.getpreferredencoding(False))
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    temp = wheel.with_name(wheel.name + ".part")
    with zipfile.ZipFile(wheel) as old, zipfile.ZipFile(temp, "w", zipfile.ZIP_DEFLATED) as new:
        new.writestr(name, data)
        for item in old.infolist():
            content = old.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                content = f"{name},sha256={digest},{len(data)}\n".encode() + content
            new.writestr(item, content)
    temp.replace(wheel)
