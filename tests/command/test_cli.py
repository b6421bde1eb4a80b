"""``fxpipe inspect``: end to end on the examples factory, and every bad input it refuses."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest
import torch

import fxpipe
from fxpipe.command import cli
from fxpipe.command.factory import load_factory, parse_shape
from fxpipe.ir import CheckpointMode, CostMode, TracerName

ROOT = Path(__file__).resolve().parents[2]
FACTORY = "examples/factories.py:unet"
FAST = ["--shape", "2,3,16,16", "--devices", "cpu,cpu", "--cost", "flops"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny models; immune to a busy machine
    return subprocess.run(
        [sys.executable, "-m", "fxpipe", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )


@pytest.mark.slow
def test_inspect_end_to_end(tmp_path: Path) -> None:
    html, dot = tmp_path / "report.html", tmp_path / "plan.dot"
    done = _cli(
        "inspect", FACTORY, *FAST, "--chunks", "2", "--run", "--html", str(html), "--dot", str(dot)
    )
    assert done.returncode == 0, done.stderr
    assert "PipelinePlan: 2 stages" in done.stdout and "bottleneck:" in done.stdout
    assert "Timeline:" in done.stdout and "measured bubble" in done.stdout
    assert done.stderr == ""  # no terminal: no progress line
    text = html.read_text()
    assert text.startswith("<!DOCTYPE html>") and 'id="timeline"' in text
    assert dot.read_text().startswith("digraph plan {")


@pytest.mark.slow
def test_bad_input_exits_2_without_traceback() -> None:
    done = _cli("inspect", "examples/factories.py:nothing_here", "--shape", "2,3,16,16")
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr
    assert "nothing_here" in done.stderr


def test_console_script_entry_point() -> None:
    scripts = importlib.metadata.entry_points(group="console_scripts")
    (script,) = [e for e in scripts if e.name == "fxpipe"] or [None]
    if script is None:
        pytest.skip("fxpipe is not installed with its console script")
    assert script.value == "fxpipe.__main__:main" and script.load() is cli.main


def _main(capsys: Any, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["no_such_package.models:make", "--shape", "2,3"],
            "cannot import module 'no_such_package",
        ),
        (["examples/missing.py:unet", "--shape", "2,3"], "'examples/missing.py' does not exist"),
        (["examples/factories.py", "--shape", "2,3"], "must look like package.module:function"),
        (["examples/factories.py:DoubleConv.nope", "--shape", "2"], "no attribute"),
        ([FACTORY, "--shape", "8,a,3"], "shape '8,a,3' does not parse"),
        ([FACTORY, "--shape", "0,3"], "shape '0,3' does not parse"),
        ([FACTORY, "--input", "torch.randn(2, 3, 16"], "--input 'torch.randn"),
        ([FACTORY, "--input", "open('x')"], "name 'open' is not defined"),
        ([FACTORY, "--input", "3"], "with no tensor"),
        ([FACTORY], "give the example input"),
        ([FACTORY, *FAST, "--html", "no/such/folder/r.html"], "folder 'no/such/folder'"),
        ([FACTORY, *FAST, "--draw", "plan.gif"], "'plan.gif'.*suffix must be one of .svg"),
        ([FACTORY, *FAST, "--balance", "b.dot"], "suffix must be one of .png"),
        ([FACTORY, *FAST, "--chunks", "0"], "--chunks 0"),
        ([FACTORY, "--shape", "2,3,16,16", "--devices", "cpu,tpu:9"], "tpu"),
        (["math:pi", "--shape", "2"], "is a float, not a callable"),
        (["math:sqrt", "--shape", "2"], "calling factory 'math:sqrt' failed"),
        (["os:getcwd", "--shape", "2"], "returned a str, not an nn.Module"),
    ],
)
def test_bad_inputs(capsys: Any, monkeypatch: Any, args: list[str], message: str) -> None:
    monkeypatch.chdir(ROOT)
    code, out, err = _main(capsys, "inspect", *args)
    assert code == 2 and out == ""
    assert err.startswith("error: ")
    assert re.search(message, err), err


def test_module_factory_and_tuple_input(capsys: Any, monkeypatch: Any, tmp_path: Path) -> None:
    (tmp_path / "my_models.py").write_text(
        "import torch\n\n"
        "class Two(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)\n"
        "    def forward(self, x, y):\n"
        "        return self.b(torch.relu(self.a(x)) + y)\n\n"
        "def make():\n"
        "    return Two()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = _main(
        capsys,
        "inspect",
        "my_models:make",
        "--input",
        "(torch.randn(4, 4), torch.randn(4, 4))",
        "--devices",
        "cpu,cpu",
        "--cost",
        "params",
    )
    assert code == 0, err
    assert "PipelinePlan: 2 stages" in out


def test_helpers() -> None:
    assert parse_shape("8, 3, 224, 224") == parse_shape("8x3x224x224") == (8, 3, 224, 224)
    assert parse_shape("(4,)") == (4,)
    assert load_factory(f"{ROOT / 'examples' / 'factories.py'}:gpt").__name__ == "gpt"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal() -> None:
    quiet = io.StringIO()
    with cli._progress("fxpipe: planning", quiet):
        pass
    assert quiet.getvalue() == ""
    loud = _Terminal()
    with cli._progress("fxpipe: planning", loud):
        from fxpipe.passes.price import estimate as cost_model

        assert cost_model._Pricer.run_node.__name__ == "run_node"
    assert "fxpipe: planning: done in" in loud.getvalue()


def test_version_prints_fxpipe_and_torch(capsys: Any) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out == f"fxpipe {fxpipe.__version__} (torch {torch.__version__})\n"
    try:
        installed = importlib.metadata.version("fxpipe")
    except importlib.metadata.PackageNotFoundError:
        return
    assert installed == fxpipe.__version__


@pytest.mark.slow
def test_version_from_the_command_line() -> None:
    done = _cli("--version")
    assert done.returncode == 0 and done.stdout.startswith(f"fxpipe {fxpipe.__version__} ")


def _inspect_parser() -> argparse.ArgumentParser:
    actions = cli._parser()._actions
    sub = next(a for a in actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["inspect"]
    return parser


def test_every_inspect_option_has_help_text(capsys: Any) -> None:
    parser = _inspect_parser()
    undocumented = [a.dest for a in parser._actions if len((a.help or "").split()) < 3]
    assert undocumented == []
    with pytest.raises(SystemExit) as done:
        cli.main(["inspect", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for action in parser._actions:
        assert " ".join((action.help or "").split()) in text  # rendered, not only declared


@pytest.mark.parametrize(
    "dest, alias, more",
    [
        ("cost", CostMode, ()),
        ("checkpoint", CheckpointMode, ("auto",)),
        ("tracer", TracerName, ()),
    ],
)
def test_option_choices_are_the_api_choices_and_each_is_explained(
    dest: str, alias: Any, more: tuple[str, ...]
) -> None:
    (action,) = [a for a in _inspect_parser()._actions if a.dest == dest]
    assert tuple(action.choices or ()) == (*get_args(alias), *more)
    for choice in (*get_args(alias), *more):
        assert re.search(rf"\b{choice}\b", action.help or ""), (dest, choice)
    assert action.default in get_args(alias)  # and the help says which one it is:
    assert re.search(rf"\b{action.default}\b[^;]*(; |\()the default\)", action.help or "")


# ---------------------------------------------- bad models: the library's errors, said in one line

CUDA_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0

FACTORIES = """
import torch
from torch import nn


class Gate(nn.Module):
    def forward(self, h):
        if h.sum() > 0:
            return h
        return -h


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.fc(x))


class Mean(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x), self.fc(x).mean().item()


def untraceable():
    return Untraceable()


def small():
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def mean():
    return Mean()
"""

CLI_CASES = {
    "untraceable model": (["untraceable", "--shape", "4,4"], r"(?s)could not trace .*'gate'"),
    "more devices than cut points": (
        ["small", "--shape", "4,4", "--devices", ",".join(["cpu"] * 9)],
        r"at most \d+ stages",
    ),
    "output read out of a tensor": (["mean", "--shape", "4,4"], "'item'"),
    "keyword inputs not a dict": (
        ["small", "--shape", "4,4", "--kwargs", "[1, 2]"],
        "--kwargs must be a dict",
    ),
    "devices name no device": (["small", "--shape", "4,4", "--devices", " , "], "no device"),
    "run on an absent GPU": (
        ["small", "--shape", "4,4", "--devices", f"cpu,cuda:{CUDA_COUNT}", "--run"],
        "not present",
    ),
}


@pytest.mark.parametrize("case", list(CLI_CASES), ids=list(CLI_CASES))
def test_the_cli_refuses_bad_input_with_exit_2_and_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line turns the same errors into ``error: ...`` and exit status 2."""
    factories = tmp_path / "factories.py"
    factories.write_text(FACTORIES)
    name, *rest = CLI_CASES[case][0]
    code = cli.main(["inspect", f"{factories}:{name}", "--cost", "flops", *rest])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("error: ") and "Traceback" not in err
    assert re.search(CLI_CASES[case][1], err), err


def test_auto_configuration_prints_the_table_it_chose_from(capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.chdir(ROOT)
    code, out, err = _main(
        capsys, "inspect", FACTORY, "--shape", "4,3,16,16", "--devices", "cpu,cpu",
        "--chunks", "auto", "--checkpoint", "auto",
    )  # fmt: skip
    assert code == 0, err
    plan = fxpipe.plan(
        load_factory(FACTORY)(), torch.randn(4, 3, 16, 16), ["cpu", "cpu"], chunks="auto",
        checkpoint="auto",
    )  # fmt: skip
    assert str(plan.configurations()) in out and "chosen from" in out
