"""Packaging: ``passes/`` is importable only as ``fxpipe.passes``; module docstrings; layering;
the tests mirror the package (a test file in a folder is named after the module it tests, and
every pass module has one)."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse
from urllib.request import url2pathname

import pytest

ROOT = Path(__file__).resolve().parents[1]
PASSES = ROOT / "passes"
PASS_FILES = sorted(PASSES.rglob("*.py"))
#: Every source file once (fxpipe/passes is a link to passes/).
SOURCES = [p for p in sorted((ROOT / "fxpipe").rglob("*.py")) if "passes" not in p.parts]
SOURCES += PASS_FILES
#: Every module of passes/ by its path there: ``price/roofline`` (packages' __init__ too).
PASS_MODULES = sorted(p.relative_to(PASSES).with_suffix("").as_posix() for p in PASS_FILES)
FORBIDDEN_IN_PASSES = ("fxpipe.runtime", "fxpipe.api", "fxpipe.pipeline")

RUN_EVERY_PASS = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    from fxpipe.trace.tracing import trace
    from fxpipe.passes.price.estimate import estimate_costs
    from fxpipe.passes.partition.cost_graph import to_networkx
    from fxpipe.passes.partition.units import build_units
    from fxpipe.passes.partition.search import partition_graph
    from fxpipe.passes.split.plan import build_plan
    from fxpipe.passes.split.codegen import split_stages, run_stages

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    t = trace(model, (torch.randn(3, 4),))
    costs = estimate_costs(t.graph_module, t.example_values, mode="flops")
    g = to_networkx(t.graph_module, costs)
    build_units(g)
    part = partition_graph(g, 2)
    plan = build_plan(t.graph_module, costs, g, part, [torch.device("cpu")] * 2, chunks=2)
    for mode in ("direct", "relay"):
        run_stages(split_stages(plan, t.output_spec, traffic=mode), t.example_values)
    """
)


def _loaded_from_passes() -> list[str]:
    """Names of loaded modules whose file is in ``passes/``."""
    out = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and PASSES in Path(path).resolve().parents:
            out.append(name)
    return sorted(out)


def test_passes_import_as_fxpipe_passes() -> None:
    partition = importlib.import_module("fxpipe.passes.partition.search")
    assert partition.__name__ == "fxpipe.passes.partition.search"
    assert callable(partition.partition_graph)
    package = Path(importlib.import_module("fxpipe.passes").__file__).resolve().parent
    for stem in PASS_MODULES:
        name = "fxpipe.passes." + stem.replace("/", ".").removesuffix(".__init__")
        module = importlib.import_module(name.removesuffix(".__init__"))
        assert module.__name__ == name.removesuffix(".__init__")
        assert Path(module.__file__).resolve() == package / f"{stem}.py"


def test_no_module_named_passes_after_running_every_pass() -> None:
    exec(compile(RUN_EVERY_PASS, "<every pass>", "exec"), {})
    assert "passes" not in sys.modules
    assert not [n for n in sys.modules if n.startswith("passes.")]
    assert all(n.startswith("fxpipe.passes") for n in _loaded_from_passes())


@pytest.mark.slow
def test_no_module_named_passes_in_a_fresh_interpreter() -> None:
    check = RUN_EVERY_PASS + textwrap.dedent(
        f"""
        from pathlib import Path
        folder = Path({str(PASSES)!r})
        stray = [n for n, m in list(sys.modules.items())
                 if n == "passes" or n.startswith("passes.")
                 or (getattr(m, "__file__", None) and Path(m.__file__).resolve().parent == folder
                     and not n.startswith("fxpipe.passes"))]
        print(sorted(stray))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_opens_with_a_docstring(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    assert tree.body, f"{path.name} is empty"
    first = tree.body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    assert isinstance(first.value.value, str) and first.value.value.strip()


def _imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            assert node.module is not None
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


@pytest.mark.parametrize("path", PASS_FILES, ids=lambda p: str(p.relative_to(PASSES)))
def test_passes_never_import_the_runtime_or_the_api(path: Path) -> None:
    for name in _imported_modules(path):
        for banned in FORBIDDEN_IN_PASSES:
            assert name != banned and not name.startswith(banned + "."), f"{path.name}: {name}"
        top = name.split(".")[0]
        assert top != "passes", f"{path.name} imports the bare name {name}"
        allowed_fxpipe = ("fxpipe.ir", "fxpipe.errors", "fxpipe.model_state", "fxpipe.passes")
        if top == "fxpipe":
            assert name.startswith(allowed_fxpipe), f"{path.name}: {name}"
        else:
            assert top in sys.stdlib_module_names or top in {"torch", "networkx", "numpy"}, (
                f"{path.name}: {name}"
            )


#: fxpipe's layers, lowest first: a module imports fxpipe modules of its own layer and of
#: those below only (the README's "How it works" draws them). The passes import the first
#: layer alone (above), and the runtime and the Pipeline never import a pass.
LAYERS: list[tuple[str, ...]] = [
    ("fxpipe.errors", "fxpipe.ir", "fxpipe.model_state", "fxpipe.progress"),
    ("fxpipe.passes", "fxpipe.devices"),
    ("fxpipe.trace", "fxpipe.options", "fxpipe.interop"),
    ("fxpipe.runtime", "fxpipe.weights"),
    ("fxpipe.compiler",),
    ("fxpipe.generation",),
    ("fxpipe.pipeline",),
    ("fxpipe.views",),
    ("fxpipe.api", "fxpipe.distributed"),
    ("fxpipe", "fxpipe.__main__", "fxpipe.command"),  # the command line: the package's user
]
NEVER_A_PASS = ("fxpipe.runtime", "fxpipe.pipeline")


def _module_name(path: Path) -> str:
    """``fxpipe.runtime.executor`` for fxpipe/runtime/executor.py (passes/x.py is
    fxpipe.passes.x; a package's __init__ is the package)."""
    relative = path.relative_to(ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[0] == "passes":
        parts = ["fxpipe", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(name: str) -> int:
    """The layer of module ``name`` (its longest listed prefix)."""
    best, found = -1, -1
    for k, layer in enumerate(LAYERS):
        for prefix in layer:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), k
    assert found >= 0, f"{name} is in no layer: add it to LAYERS"
    return found


def _fxpipe_imports(path: Path) -> set[str]:
    """The fxpipe modules ``path`` imports (a name imported from a module counts as that
    module, unless it is a module itself)."""
    known = {_module_name(p) for p in SOURCES}
    out = set()
    for name in _imported_modules(path):
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name.startswith("fxpipe"):
            out.add(name)
    return out - {_module_name(path)}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_layers(path: Path) -> None:
    me = _module_name(path)
    for name in _fxpipe_imports(path):
        assert _layer(name) <= _layer(me), (
            f"{me} (layer {_layer(me)}) imports {name} (layer {_layer(name)}): a layer imports "
            "its own and lower ones only; move what it needs down"
        )
        if me.startswith(NEVER_A_PASS):
            assert not name.startswith("fxpipe.passes"), f"{me} imports the pass {name}"


#: fxpipe.distributed's rooms, lowest first, as its docstring draws them: ``build`` joins
#: the rooms, a rank's runtime reads the plans, planning reads the state across ranks.
DISTRIBUTED_ROOMS = ["options", "parallel", "planning", "rank", "build"]
DISTRIBUTED = [p for p in SOURCES if _module_name(p).startswith("fxpipe.distributed.")]


def _room(name: str) -> int:
    """The room of a module of fxpipe.distributed (``fxpipe.distributed.rank.stage``: rank)."""
    return DISTRIBUTED_ROOMS.index(name.split(".")[2])


@pytest.mark.parametrize("path", DISTRIBUTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_distributed_rooms_import_downwards(path: Path) -> None:
    me = _module_name(path)
    for name in _fxpipe_imports(path):
        if name.startswith("fxpipe.distributed.") and name.count(".") >= 2:
            assert _room(name) <= _room(me), f"{me} imports {name}, a room above it"


def test_no_distributed_module_is_over_about_400_lines() -> None:
    lengths = {_module_name(p): len(p.read_text().splitlines()) for p in DISTRIBUTED}
    assert max(lengths.values()) <= 430, sorted(lengths.items(), key=lambda kv: -kv[1])[:3]


def test_no_module_imports_itself_round_about() -> None:
    """No import cycle between fxpipe's modules, imports under TYPE_CHECKING and inside
    functions included."""
    import networkx as nx

    graph = nx.DiGraph()
    for path in SOURCES:
        me = _module_name(path)
        graph.add_node(me)
        graph.add_edges_from((me, name) for name in _fxpipe_imports(path) if name != "fxpipe")
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles: {cycles[:3]}"


def test_the_ast_check_sees_a_banned_import(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""x"""\nfrom fxpipe.runtime.worker import Worker\nimport fxpipe.api\n'
        "def f():\n    from fxpipe.pipeline import Pipeline\n"
    )
    assert {"fxpipe.runtime.worker", "fxpipe.api", "fxpipe.pipeline"} <= set(
        _imported_modules(sample)
    )


def test_import_fxpipe_exposes_the_public_api() -> None:
    import fxpipe

    assert fxpipe.__file__ is not None
    assert callable(fxpipe.pipeline) and callable(fxpipe.plan)
    assert isinstance(fxpipe.Pipeline, type) and isinstance(fxpipe.PipelinePlan, type)
    assert issubclass(fxpipe.FxPipeError, Exception)
    assert "passes" not in sys.modules


def _editable_install() -> importlib.metadata.Distribution:
    """fxpipe's distribution when it is installed in editable mode from this checkout."""
    # every fxpipe on the path: ./fxpipe.egg-info, left by a build, may come first
    found = [
        (dist, json.loads(dist.read_text("direct_url.json") or "{}"))
        for dist in importlib.metadata.distributions(name="fxpipe")
    ]
    editable = [(d, url) for d, url in found if url.get("dir_info", {}).get("editable")]
    if not editable:
        pytest.skip("fxpipe is not installed in editable mode")
    dist, direct = editable[0]
    if Path(url2pathname(urlparse(direct["url"]).path)).resolve() != ROOT:
        pytest.skip("fxpipe is installed in editable mode from another checkout")
    return dist


def test_the_editable_install_puts_a_static_fxpipe_with_passes_on_sys_path() -> None:
    """Type checkers do not run import hooks: the editable install is setuptools' strict mode
    (setup.cfg), whose .pth file names a folder laid out as the installed package, with
    passes/ as fxpipe/passes and no top-level passes."""
    dist = _editable_install()
    lines = [
        line.strip()
        for file in dist.files or []
        if file.name.endswith(".pth")
        for line in Path(str(file.locate())).read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    hooks = [line for line in lines if line.startswith(("import ", "import\t"))]
    assert not hooks, f"the editable install runs an import hook: {hooks}"
    folders = [Path(line) for line in lines]
    assert len(folders) == 1, folders
    package = folders[0] / "fxpipe"
    assert (package / "py.typed").is_file()
    assert (package / "__init__.py").resolve() == ROOT / "fxpipe" / "__init__.py"
    installed = sorted(
        p.relative_to(package / "passes") for p in (package / "passes").rglob("*.py")
    )
    assert installed == sorted(p.relative_to(PASSES) for p in PASS_FILES), (
        "a module added to or removed from passes/ since the last pip install -e"
    )
    for stem in PASS_MODULES:
        assert (package / "passes" / f"{stem}.py").resolve() == PASSES / f"{stem}.py"
    assert sorted(p.name for p in folders[0].iterdir()) == ["fxpipe"]


#: Outside the repository, mypy must read fxpipe.passes' own signatures: calling a pass with
#: a wrong type is an error only when it does (a module it cannot see is Any, or missing).
USER_CODE = textwrap.dedent(
    """
    from fxpipe.passes.partition.search import partition_graph

    partition_graph(None, "two")
    """
)


def test_mypy_outside_the_repository_reads_fxpipe_passes(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy comes with the dev extra")
    (tmp_path / "user.py").write_text(USER_CODE)
    # torch, networkx and numpy unread: the check is about fxpipe, and they take minutes
    config = "[mypy]\n[mypy-torch.*,networkx.*,numpy.*]\nfollow_imports = skip\n"
    (tmp_path / "mypy.ini").write_text(config)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", "cache"]
        + ["--no-error-summary", "user.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    errors = done.stdout.strip().splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert len(errors) == 1, errors
    wrong = 'Argument 2 to "partition_graph" has incompatible type "str"; expected "int"'
    assert errors[0].startswith("user.py:4: error: " + wrong), errors


def test_python_started_in_the_repository_root_finds_fxpipe_passes() -> None:
    """There ./fxpipe comes first on sys.path; its link fxpipe/passes makes it whole."""
    show = (
        "import fxpipe, fxpipe.passes.partition.search as p; "
        "print(fxpipe.__file__); print(p.__file__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", show], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    package, partition = done.stdout.strip().splitlines()[-2:]
    assert Path(package) == ROOT / "fxpipe" / "__init__.py"
    assert Path(partition).resolve() == PASSES / "partition" / "search.py"


def test_the_wheel_holds_fxpipe_passes_and_no_top_level_passes(tmp_path: Path) -> None:
    """The built package comes from the package-dir mapping: fxpipe/passes holds passes/*.py
    once (the link fxpipe/passes adds no second copy), and nothing named passes is top-level.
    Built from a copy of the sources, so that the build leaves nothing in the checkout."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        (source / name).write_bytes((ROOT / name).read_bytes())
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "fxpipe", source / "fxpipe", symlinks=True, ignore=skip)
    shutil.copytree(PASSES, source / "passes", ignore=skip)
    # the environment's setuptools where there is one, else pip fetches it
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation]
        + ["-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("fxpipe-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_level = archive.read(next(n for n in names if n.endswith(".dist-info/top_level.txt")))
        passes = {n: archive.read(n) for n in names if n.startswith("fxpipe/passes/")}
    tops = {n.split("/")[0] for n in names}
    assert tops == {"fxpipe", f"fxpipe-{wheel.name.split('-')[1]}.dist-info"}
    assert top_level.decode().split() == ["fxpipe"]
    want = {
        f"fxpipe/passes/{p.relative_to(PASSES).as_posix()}": p.read_bytes() for p in PASS_FILES
    }
    assert passes == want
    assert "fxpipe/py.typed" in names


# ---------------------------------------------------------------- the tests mirror the package

TESTS = ROOT / "tests"
#: Test files in a folder of tests/: tests/views/test_report.py tests fxpipe/views/report.py,
#: tests/passes/price/test_estimate.py passes/price/estimate.py (the top level of tests/ holds
#: the front door's and the integration tests, named by what they check).
MIRRORED_TESTS = sorted(p for p in TESTS.rglob("test_*.py") if p.parent != TESTS)
#: Pass modules without a test file of their own, and the test file that tests them (through
#: the module it is named after, which imports them).
TESTED_WITH = {
    "price/op_work": "tests/passes/price/test_roofline.py",
    "price/timing": "tests/passes/price/test_estimate.py",
    "partition/units": "tests/passes/partition/test_search.py",
    "partition/exact": "tests/passes/partition/test_search.py",
    "partition/orders": "tests/passes/partition/test_search.py",
    "partition/objective": "tests/passes/partition/test_search.py",
    "partition/memory": "tests/passes/partition/test_memory_tables.py",
    "batch/roles": "tests/passes/batch/test_reductions.py",
    "tensor/values": "tests/passes/tensor/test_plan.py",
    "tensor/cuts": "tests/passes/tensor/test_layouts.py",
    "tensor/search": "tests/passes/tensor/test_plan.py",
    "tensor/assembly": "tests/passes/tensor/test_plan.py",
    "batch/losses": "tests/passes/batch/test_reductions.py",
    "tensor/local_sizes": "tests/passes/tensor/test_local.py",
    "tensor/local_regions": "tests/passes/tensor/test_partial.py",
}


def _source_folder(folder: Path) -> Path:
    """The source folder a folder of tests/ mirrors: passes/partition for
    tests/passes/partition, fxpipe/views for tests/views."""
    first, *rest = folder.relative_to(TESTS).parts
    return PASSES.joinpath(*rest) if first == "passes" else ROOT.joinpath("fxpipe", first, *rest)


def _tested_module(test_file: Path) -> str | None:
    """The module of the mirrored folder that ``test_file`` is named after: ``test_<module>.py``
    or ``test_<module>_<topic>.py`` (the longest such module; the folder's own name is its
    package), or None."""
    folder = _source_folder(test_file.parent)
    if not folder.is_dir():
        return None
    names = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"] + [folder.name]
    stem = test_file.stem.removeprefix("test_")
    named = [n for n in names if stem == n or stem.startswith(n + "_")]
    return max(named, key=len, default=None)


@pytest.mark.parametrize("path", MIRRORED_TESTS, ids=lambda p: str(p.relative_to(TESTS)))
def test_a_test_file_in_a_folder_is_named_after_the_module_it_tests(path: Path) -> None:
    folder = _source_folder(path.parent)
    assert folder.is_dir(), f"{path.relative_to(ROOT)}: no {folder.relative_to(ROOT)} to mirror"
    assert _tested_module(path) is not None, (
        f"{path.relative_to(ROOT)} is named after no module of {folder.relative_to(ROOT)}: "
        "name it test_<module>.py (or test_<module>_<topic>.py), or move it"
    )


def _own_test_files(stem: str) -> list[Path]:
    """The test files named after the pass module ``stem`` (``partition/search``)."""
    module = PurePosixPath(stem)
    folder = TESTS / "passes" / module.parent
    return sorted(p for p in folder.glob("test_*.py") if _tested_module(p) == module.name)


def _passes_reached(test_file: Path) -> set[str]:
    """The pass modules ``test_file`` imports, and those they import in turn."""
    paths = {_module_name(p): p for p in PASS_FILES}
    todo = set()
    for name in _imported_modules(test_file):
        while name and name not in paths:
            name = name.rpartition(".")[0]
        if name:
            todo.add(name)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        seen.add(name)
        todo |= {n for n in _fxpipe_imports(paths[name]) if n in paths} - seen
    return seen


PASS_STEMS = [stem for stem in PASS_MODULES if not stem.endswith("__init__")]


@pytest.mark.parametrize("stem", PASS_STEMS)
def test_every_pass_module_has_a_test_file(stem: str) -> None:
    own = _own_test_files(stem)
    if stem not in TESTED_WITH:
        folder, _, name = f"tests/passes/{stem}".rpartition("/")
        assert own, (
            f"passes/{stem}.py has no {folder}/test_{name}.py: write it, or name the test file "
            "that tests it in TESTED_WITH"
        )
        return
    assert not own, f"passes/{stem}.py has its own {own[0].name}: drop it from TESTED_WITH"
    test_file = ROOT / TESTED_WITH[stem]
    assert test_file.is_file(), f"TESTED_WITH names {TESTED_WITH[stem]}, which is not there"
    module = "fxpipe.passes." + stem.replace("/", ".")
    assert module in _passes_reached(test_file), f"{TESTED_WITH[stem]} never imports {module}"


def test_tested_with_names_only_pass_modules() -> None:
    assert set(TESTED_WITH) <= set(PASS_STEMS), set(TESTED_WITH) - set(PASS_STEMS)


#: The modules that may import the package root: the command line, the package's own user.
ROOT_USERS = ("fxpipe.__main__", "fxpipe.command")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_below_the_root_imports_it_and_the_runtime_never_imports_the_pipeline(
    path: Path,
) -> None:
    """The package root and ``fxpipe.pipeline`` are imported from above only: no module
    below the root imports ``fxpipe`` itself (but the command line), and the runtime and
    the weights' loading import no ``Pipeline`` (they read what they need of it)."""
    me = _module_name(path)
    names = _imported_modules(path)
    if me != "fxpipe" and not me.startswith(ROOT_USERS):
        assert "fxpipe" not in names, f"{me} imports the package root"
    if me.startswith(("fxpipe.runtime", "fxpipe.weights")):
        assert not any(n == "fxpipe.pipeline" or n.startswith("fxpipe.pipeline.") for n in names)


def test_a_plan_shows_itself_through_the_views_it_names() -> None:
    """The records name the views that show a plan, which exist (and import none of them)."""
    import fxpipe.ir as ir
    import fxpipe.views as views

    for name, function in ir._PLAN_VIEWS.items():
        assert callable(getattr(views, function)), name


def test_a_runs_chunks_and_checkpoint_are_resolved_in_one_place() -> None:
    """The micro-batches a run uses and its checkpoint mode per stage are worked out by one
    function each (the compiler's ``resolve_run``, the options' ``checkpoint_of_stages``),
    which nothing restates: the runtime and the Pipeline take the resolved values."""
    texts = {
        _module_name(p): p.read_text() for p in SOURCES if _module_name(p).startswith("fxpipe")
    }
    chunk_rule = [m for m, t in texts.items() if "min(run.chunks" in t]
    collapse = [  # (a view prints equal modes as one, which resolves nothing)
        m for m, t in texts.items() if "len(set(modes)) == 1" in t and "views" not in m
    ]
    assert chunk_rule == ["fxpipe.compiler.resolve"], chunk_rule
    assert collapse == ["fxpipe.options"], collapse
    for module in ("fxpipe.pipeline", "fxpipe.runtime.session"):
        assert "plan.chunks" not in texts[module] and '"auto"' not in texts[module], module
