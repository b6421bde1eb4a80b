"""What a training tool reads of a pipeline, which stands where its model stood: the model's
forward signature (also under Accelerate's mixed-precision wrapping), its attributes, the
device map, and ``to()`` / ``_apply`` (moves refused, dtype changes made in place)."""

from __future__ import annotations

import copy
import inspect
import pickle
from collections.abc import Iterator

import pytest
import torch
from oracle import relative_error
from torch import nn
from trainer_cases import CASES, DEVICES, Tagger, case_pipeline

import fxpipe
from fxpipe.errors import ConfigError, DeviceError
from fxpipe.interop.trainers import device_map

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps one process-wide state; each test starts from none."""
    yield
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


# ------------------------------------------------------------------- what a trainer reads


class Labelled(nn.Module):
    """A model whose forward names its labels (as Hugging Face models' do) and a buffer."""

    main_input_name = "x"

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)
        self.register_buffer("scale", torch.full((3,), 2.0))
        self.config = {"hidden": 8}

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale

    def describe(self) -> str:
        return f"Labelled({self.config['hidden']})"


def _labelled() -> tuple[nn.Module, fxpipe.Pipeline]:
    torch.manual_seed(0)
    model = Labelled()
    return model, fxpipe.pipeline(model, torch.randn(6, 4), DEVICES, chunks=2)


def test_forward_signature_is_the_models_per_pipeline() -> None:
    model, pipe = _labelled()
    tagger = case_pipeline(CASES[0], CASES[0].build())
    assert inspect.signature(pipe.forward) == inspect.signature(model.forward)
    assert inspect.signature(tagger.forward) == inspect.signature(Tagger().forward)
    assert isinstance(pipe, fxpipe.Pipeline) and isinstance(tagger, fxpipe.Pipeline)
    assert type(pipe).__name__ == "Pipeline"
    # Trainer reads the label names from the class's forward
    find_labels = transformers.utils.find_labels
    assert find_labels(type(pipe)) == find_labels(type(model)) == ["labels"]
    assert find_labels(type(tagger)) == []
    copied = copy.deepcopy(pipe)
    assert inspect.signature(copied.forward) == inspect.signature(model.forward)
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))  # a class pickle finds
    assert pickle.dumps(fxpipe.pipeline(plain, torch.randn(4, 4), DEVICES, chunks=2))


def test_forward_signature_survives_accelerates_mixed_precision_wrapping() -> None:
    """``prepare`` under mixed precision rewraps ``forward`` (autocast, outputs to float32);
    unwrapping puts it back. The signature is the model's throughout, and the wrapped call
    runs the pipeline under autocast."""
    model, pipe = _labelled()
    eager = copy.deepcopy(model)
    x = torch.randn(6, 4)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    prepared = accelerator.prepare(pipe)
    assert prepared is pipe and "_original_forward" in pipe.__dict__
    assert inspect.signature(prepared.forward) == inspect.signature(model.forward)
    got = prepared(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = eager(x).float()
    assert got.dtype == torch.float32 and relative_error(got, want) < 1e-2  # bf16 rounding
    unwrapped = accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)
    assert unwrapped is pipe and "_original_forward" not in pipe.__dict__
    assert inspect.signature(unwrapped.forward) == inspect.signature(model.forward)
    torch.testing.assert_close(unwrapped(x), model(x))


def test_attributes_a_trainer_reads_come_from_the_model() -> None:
    model, pipe = _labelled()
    assert pipe.config is model.config and pipe.main_input_name == "x"
    assert pipe.describe() == "Labelled(8)"
    assert pipe.a is model.a and pipe.module is model  # nn.Module's own lookup first
    assert pipe.chunks == 2 and pipe.training
    assert not hasattr(pipe, "accepts_loss_kwargs")  # Trainer then reads the signature
    assert not hasattr(pipe, "_private_state")
    model._keys_to_ignore_on_save = ["scale"]
    assert pipe._keys_to_ignore_on_save == ["scale"]
    with pytest.raises(AttributeError, match="neither has its model"):
        pipe.save_pretrained  # noqa: B018


def test_device_map_says_where_the_model_is() -> None:
    model, pipe = _labelled()
    assert pipe.hf_device_map == {"": "cpu"}
    accelerator = accelerate.Accelerator(cpu=True)
    assert not accelerator.verify_device_map(pipe)  # one device: Accelerate places it
    assert pipe.hf_device_map == device_map(model)
    # A model over two devices (meta stands for the second here) is named module by module,
    # one entry for a module whose tensors share a device, as Accelerate's maps are.
    spread = Labelled()
    spread.a.to("meta")
    spread.b.bias = nn.Parameter(torch.empty_like(spread.b.bias, device="meta"))
    assert device_map(spread) == {"a": "meta", "b.weight": "cpu", "b.bias": "meta", "scale": "cpu"}


# ------------------------------------------------------------------------------ to() and _apply


def test_to_where_the_stages_are_moves_nothing() -> None:
    model, pipe = _labelled()
    before = [(t, t.data_ptr()) for t in [*model.parameters(), *model.buffers()]]
    assert pipe.to("cpu") is pipe and pipe.cpu() is pipe and pipe.to(torch.device("cpu")) is pipe
    assert pipe.float() is pipe
    assert [(t, t.data_ptr()) for t in [*model.parameters(), *model.buffers()]] == before


def test_dtype_changes_in_place_also_from_a_parent_module() -> None:
    """``parent.to(torch.float64)`` (as a LightningModule's ``to`` does) reaches the pipeline
    through ``_apply``: parameters, buffers and gradients change dtype, the same objects."""
    model, pipe = _labelled()
    eager = copy.deepcopy(model).double()
    parent = nn.ModuleDict({"net": pipe})
    x = torch.randn(6, 4, dtype=torch.float64)
    pipe(x.float()).sum().backward()
    objects = [*model.parameters(), *model.buffers()]
    assert parent.to(torch.float64) is parent
    assert [*model.parameters(), *model.buffers()] == objects
    assert all(t.dtype == torch.float64 for t in objects)
    assert all(p.grad is not None and p.grad.dtype == torch.float64 for p in model.parameters())
    torch.testing.assert_close(pipe(x), eager(x))
    assert pipe.half() is pipe and model.scale.dtype == torch.float16


def test_a_parent_module_saves_and_loads_the_pipeline_under_the_models_keys() -> None:
    model, pipe = _labelled()
    parent = nn.ModuleDict({"net": pipe})
    state = {k: v + 1 for k, v in parent.state_dict().items()}
    assert state.keys() == {f"net.{k}" for k in model.state_dict()}
    parent.load_state_dict(state)
    assert all(torch.equal(model.state_dict()[k[4:]], v) for k, v in state.items())
    with pytest.raises(ConfigError, match=r"assign=True\).* pipeline at 'net'"):
        parent.load_state_dict(state, assign=True)


def test_a_real_move_is_refused_before_anything_changes() -> None:
    model, pipe = _labelled()
    refused = r"\['cpu', 'cpu'\]; to\('meta'\) cannot move it to meta"
    with pytest.raises(DeviceError, match=refused):
        pipe.to("meta", torch.float64)
    with pytest.raises(DeviceError, match=r"to\(\) or _apply\(\) cannot move it to meta"):
        nn.Sequential(pipe).to("meta")  # a parent's to() reaches the pipeline through _apply
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in model.parameters())


def test_a_move_to_the_first_stages_device_changes_only_the_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pipeline over two devices taken to its first stage's device (where inputs enter)
    stays where it is. Simulated on the CPU: the first stage is said to be on ``meta``."""
    model, pipe = _labelled()
    monkeypatch.setattr(pipe, "devices", (torch.device("meta"), torch.device("cpu")))
    assert pipe.to("meta", torch.float64) is pipe
    assert all(t.device.type == "cpu" and t.dtype == torch.float64 for t in model.parameters())
