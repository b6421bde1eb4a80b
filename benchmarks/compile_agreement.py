"""Compiled stages' numerical agreement: how far the compiled pipeline's gradients lie from the
uncompiled pipeline's, beside how far ``torch.compile(model)``'s lie from the eager model's,
in float32 (torch's default settings), float32 with TF32 off (``float32-no-tf32``), and
float64.

Run from the repository root::

    python -m benchmarks.compile_agreement [--device cpu|cuda] [--models cnn,decoder]
                                           [--out PATH]

Per model of ``benchmarks.compile`` and per precision, one training step on one batch of:
the model, ``torch.compile(model)``, ``fxpipe.pipeline`` over 2 stages on the device
(``chunks=1``, ``checkpoint="never"``: it runs what the model runs) and the same with
``compile=True``. Each pair's relative error is that of the loss and of all gradients as
one vector. The compiler's own disagreement with eager (``torch.compile(model)`` against
the model) is the yardstick: the compiled pipeline should disagree with the pipeline by
about as much, and both should fall to float64 rounding in float64. Where they do not in
float32 but do in float64, the difference is rounding, of the size the precision allows
(on CUDA, cuDNN's convolutions run in TF32 by default, ten mantissa bits, which the
second precision switches off). The rows go to ``benchmarks/results/compile_agreement.json``
(``compile_agreement_cuda.json`` on a GPU).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fxpipe
from benchmarks.compile import _on, _relative, _step
from benchmarks.harness.machine import device_record
from benchmarks.harness.models.steps import MODELS, Batch
from benchmarks.harness.output import command_line, format_table, result_path, save_json

#: Precision name -> (parameter dtype, whether TF32 may be used).
PRECISIONS: dict[str, tuple[torch.dtype, bool]] = {
    "float32": (torch.float32, True),
    "float32-no-tf32": (torch.float32, False),
    "float64": (torch.float64, False),
}
#: (what, against): each pair compared.
PAIRS = [
    ("torch.compile(model)", "model"),
    ("compiled pipeline", "pipeline"),
    ("pipeline", "model"),
]


@contextmanager
def _tf32(allowed: bool) -> Iterator[None]:
    """cuDNN's and the matrix products' TF32 switches set to ``allowed`` (``True``: torch's
    defaults, cuDNN on, products off), restored after."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = allowed and before[0]
    torch.backends.cuda.matmul.allow_tf32 = allowed and before[1]
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def _cast(value: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """``value`` on ``device``, in ``dtype`` if it is a floating-point tensor."""
    value = _on(value, device)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def _grads(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])


def measure(name: str, precision: str, device: torch.device) -> dict[str, Any]:
    """One step of each variant of ``name`` in ``precision``; each pair's relative errors."""
    dtype, tf32 = PRECISIONS[precision]
    torch.manual_seed(0)
    model, (args, kwargs), loss = MODELS[name]()
    model = model.to(device, dtype).train()
    batch: Batch = (
        tuple(_cast(a, dtype, device) for a in args),
        {k: _cast(v, dtype, device) for k, v in kwargs.items()},
    )
    owners: dict[str, nn.Module] = {"model": model}
    runs: dict[str, nn.Module] = {"model": model}
    owners["torch.compile(model)"] = twin = copy.deepcopy(model)
    runs["torch.compile(model)"] = torch.compile(twin)
    for compiled in (False, True):
        key = "compiled pipeline" if compiled else "pipeline"
        owners[key] = copied = copy.deepcopy(model)
        runs[key] = fxpipe.pipeline(
            copied, batch[0], [device, device], chunks=1, checkpoint="never",
            example_kwargs=batch[1], compile=compiled,
        )  # fmt: skip
    with _tf32(tf32):
        losses = {k: _step(runs[k], owners[k], batch, loss, device)() for k in runs}
    row: dict[str, Any] = {"model": name, "precision": precision}
    for what, against in PAIRS:
        row[f"{what} vs {against}"] = {
            "loss": _relative(losses[what], losses[against]),
            "grad": _relative(_grads(owners[what]), _grads(owners[against])),
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default="cnn,decoder")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    opts = parser.parse_args(argv)
    device = torch.device(opts.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    rows = []
    for name in opts.models.split(","):
        for precision in opts.precisions.split(","):
            rows.append(measure(name, precision, device))
            print(f"{name}, {precision}: done", flush=True)
    columns = [("model", lambda r: r["model"]), ("precision", lambda r: r["precision"])]
    for what, against in PAIRS:
        key = f"{what} vs {against}"
        columns.append((f"{key}: grad", lambda r, key=key: f"{r[key]['grad']:.1e}"))
    print(format_table(rows, columns, left=2))
    name = "compile_agreement" if device.type == "cpu" else f"compile_agreement_{device.type}"
    meta = {
        "command": command_line(),
        **device_record(device),
    }
    return save_json(
        Path(opts.out) if opts.out else result_path(name), {"meta": meta, "rows": rows}
    )


if __name__ == "__main__":
    raise SystemExit(main())
