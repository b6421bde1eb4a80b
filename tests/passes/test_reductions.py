"""Losses and other reductions over the batch inside the model: the pass's cut (partial sums
and counts out of the stages, the rest in the finishing graph), then every output and every
gradient of a pipeline against the eager model, over micro-batches of unequal sizes."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from oracle import relative_error
from torch import nn

import fxpipe
from fxpipe.passes.batch.reductions import split_reductions
from fxpipe.passes.batch.roles import batch_roles
from fxpipe.trace.example_checks import output_names
from fxpipe.trace.tracing import trace

pytestmark = pytest.mark.usefixtures("one_thread")

B, T, FEATURES, CLASSES = 7, 5, 6, 4  # 7 rows in 3 micro-batches: 3, 2 and 2 rows


class Tagger(nn.Module):
    """Per-token class scores, and the loss ``what`` makes of them (and of the labels, a
    padding mask, and any other argument) returned beside them."""

    def __init__(self, what: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, 16)
        self.out = nn.Linear(16, CLASSES)
        self.register_buffer("weight", torch.tensor([1.0, 2.0, 0.5, 1.5]))
        self.temperature = nn.Parameter(torch.tensor(1.3))
        self.criterion = nn.CrossEntropyLoss(weight=torch.tensor([0.5, 1.0, 2.0, 1.0]))
        self.what = what

    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor,
        mask: torch.Tensor,
        num_items: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        logits = self.out(torch.tanh(self.inp(x)))
        loss = self.what(self, logits, labels, mask, num_items)
        return {"loss": loss, "logits": logits}


def _flat(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.reshape(-1, CLASSES), labels.reshape(-1)


LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "cross_entropy mean, ignored labels": lambda m, z, y, k, n: F.cross_entropy(*_flat(z, y)),
    "cross_entropy with class weights": lambda m, z, y, k, n: F.cross_entropy(
        *_flat(z, y), weight=m.weight, ignore_index=-100
    ),
    "cross_entropy with label smoothing": lambda m, z, y, k, n: F.cross_entropy(
        *_flat(z, y), label_smoothing=0.1
    ),
    "cross_entropy summed over num_items_in_batch": lambda m, z, y, k, n: (
        F.cross_entropy(*_flat(z, y), reduction="sum") / n
    ),
    "CrossEntropyLoss module with weights": lambda m, z, y, k, n: m.criterion(*_flat(z, y)),
    "nll_loss of log_softmax": lambda m, z, y, k, n: F.nll_loss(
        torch.log_softmax(_flat(z, y)[0], -1), _flat(z, y)[1]
    ),
    "mse_loss": lambda m, z, y, k, n: F.mse_loss(z, torch.ones_like(z) * k.unsqueeze(-1)),
    "bce_with_logits with pos_weight": lambda m, z, y, k, n: F.binary_cross_entropy_with_logits(
        z, (y.unsqueeze(-1) > 1).to(z.dtype).expand_as(z), pos_weight=m.weight
    ),
    "kl_div batchmean": lambda m, z, y, k, n: F.kl_div(
        torch.log_softmax(z, -1), torch.softmax(z.detach() * 2, -1), reduction="batchmean"
    ),
    "mean over the tokens the mask keeps": lambda m, z, y, k, n: (
        (z.logsumexp(-1) * k).sum() / k.sum()
    ),
    "a mean plus a weighted auxiliary loss": lambda m, z, y, k, n: (
        z.pow(2).mean() + 0.01 * (z.softmax(-1).mean((0, 1)) * z.mean((0, 1))).sum()
    ),
    "a sum over the batch size, scaled by a parameter": lambda m, z, y, k, n: (
        z.square().sum() / z.shape[0] * m.temperature
    ),
    "a mean over dim 0 (per class)": lambda m, z, y, k, n: z.flatten(0, 1).mean(0),
}


def _inputs(rows: int = B) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, T, FEATURES, generator=g, dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (rows, T), generator=g)
    mask = (torch.rand(rows, T, generator=g) > 0.3).double()
    labels[mask == 0] = -100  # padding: not counted
    labels[0, :] = -100  # a row with nothing counted (its micro-batch counts the others)
    return (x, labels, mask), {"num_items": (labels != -100).sum() + 3}


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_loss_inside_the_model_equals_eager_with_its_gradients(name: str, tracer: str) -> None:
    torch.manual_seed(0)
    model = Tagger(LOSSES[name]).double()
    eager = copy.deepcopy(model)
    args, kwargs = _inputs()
    pipe = fxpipe.pipeline(model, args, ["cpu"] * 2, example_kwargs=kwargs, chunks=3,
                           tracer=tracer, cost="flops")  # fmt: skip
    assert pipe.variants[0].traced.finalize is not None
    got, want = pipe(*args, **kwargs), eager(*args, **kwargs)
    for key in want:
        assert relative_error(got[key], want[key]) < 1e-12, key
    weights = torch.randn_like(want["logits"])
    (got["loss"].sum() + (got["logits"] * weights).sum()).backward()
    (want["loss"].sum() + (want["logits"] * weights).sum()).backward()
    grads = dict(eager.named_parameters())
    for path, p in model.named_parameters():
        want_grad = grads[path].grad
        assert (p.grad is None) == (want_grad is None), path
        if want_grad is not None:
            assert relative_error(p.grad, want_grad) < 1e-10, path


def test_another_batch_size_and_sequence_length_still_equal_eager() -> None:
    torch.manual_seed(0)
    model = Tagger(LOSSES["cross_entropy mean, ignored labels"]).double()
    eager = copy.deepcopy(model)
    args, kwargs = _inputs()
    pipe = fxpipe.pipeline(model, args, ["cpu"] * 2, example_kwargs=kwargs, chunks=3,
                           tracer="export", cost="flops")  # fmt: skip
    x, labels, mask = (a[:5] for a in args)
    longer = (torch.cat([x, x[:, :2]], 1), torch.cat([labels, labels[:, :2]], 1),
              torch.cat([mask, mask[:, :2]], 1))  # fmt: skip
    for call in [(x, labels, mask), longer]:
        got, want = pipe(*call, **kwargs), eager(*call, **kwargs)
        assert relative_error(got["loss"], want["loss"]) < 1e-12


# ---------------------------------------------------------------------------- the pass itself


def _cut(name: str, tracer: str = "export") -> tuple[fx.GraphModule, Any, Any]:
    model = Tagger(LOSSES[name]).double()
    args, kwargs = _inputs()
    traced = trace(model, args, kwargs, tracer=tracer)
    roles = batch_roles(traced.graph_module, traced.example_values, B)
    assert roles is not None
    gm, finalize = split_reductions(traced.graph_module, roles, output_names(traced.output_spec))
    return traced.graph_module, gm, finalize


def test_a_mean_loss_leaves_the_stages_as_a_sum_and_a_count() -> None:
    before, gm, finalize = _cut("cross_entropy mean, ignored labels")
    assert finalize is not None
    assert finalize.names == ("'loss'", "'logits'")
    assert finalize.reduced == (0,)  # the loss; the logits are per-sample
    assert finalize.joins == ("cat", "sum", "sum")  # logits, summed loss, its count
    (loss,) = [n for n in gm.graph.nodes if "cross_entropy" in str(n.target)]
    assert loss.args[3:4] == (2,) or loss.kwargs.get("reduction") == 2  # 'sum'
    assert [n.name for n in before.graph.nodes if "cross_entropy" in str(n.target)]
    code = finalize.graph_module.code
    assert "truediv" in code  # the finishing graph divides the joined sum by the count
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert len(output.args[0]) == 3


def test_a_model_without_reductions_is_left_as_it_is() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    traced = trace(model, (torch.randn(5, 4),), {}, tracer="fx")
    roles = batch_roles(traced.graph_module, traced.example_values, 5)
    assert roles is not None
    gm, finalize = split_reductions(traced.graph_module, roles, ["output"])
    assert gm is traced.graph_module and finalize is None


def test_roles_tell_per_sample_values_from_reductions_and_constants() -> None:
    model = Tagger(LOSSES["mean over the tokens the mask keeps"]).double()
    args, kwargs = _inputs()
    traced = trace(model, args, kwargs, tracer="fx")
    roles = batch_roles(traced.graph_module, traced.example_values, B)
    assert roles is not None
    of = {n.name: roles.of(n) for n in traced.graph_module.graph.nodes if n.op != "output"}
    assert of["x"] == of["labels"] == of["mask"] == "batched"
    assert of["num_items"] == "static"  # a 0-dim tensor: the same for every micro-batch
    assert of["out"] == "batched"
    sums = [n for n in of if n.startswith("sum")]
    assert sums and all(of[n] == "reduced" for n in sums)
    assert of["truediv"] == "reduced"
