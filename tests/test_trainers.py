"""A pipeline trained by transformers.Trainer, accelerate.Accelerator and Lightning (Fabric and
the Lightning Trainer), each compared with the same trainer on an eager copy of the model:
the loss of every step and every parameter after the steps are equal.

A case is a model, a batch maker and where the loss comes from (a function of the outputs
and the labels, or the model's own output); each trainer test runs over ``CASES``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from oracle import relative_error
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fxpipe
from fxpipe.errors import ConfigError, DeviceError
from fxpipe.interop.trainers import device_map

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
lightning = pytest.importorskip("lightning")

pytestmark = pytest.mark.usefixtures("one_thread")

Batch = dict[str, torch.Tensor]
ROWS = 8  # rows per batch, as built and as trained
STEPS = 4
DEVICES = ["cpu", "cpu"]
TOLERANCE = 1e-5


# ------------------------------------------------------------------------------------ cases


class Tagger(nn.Module):
    """A residual MLP over a fixed-length sequence of features, one class per position."""

    def __init__(self, width: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.drop = nn.Dropout(0.0)
        self.head = nn.Linear(width, classes)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(features))
        h = h + self.drop(torch.tanh(self.mix(self.norm(h)))) * mask.unsqueeze(-1)
        return self.head(h)


def _tagger() -> nn.Module:
    torch.manual_seed(0)
    return Tagger()


def _tagger_rows(n: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return {
        "features": torch.randn(n, 3, 6, generator=g),
        "mask": (torch.rand(n, 3, generator=g) > 0.3).float(),
        "labels": torch.randint(0, 5, (n, 3), generator=g),
    }


def _tagger_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.flatten(0, 1), labels.flatten())


VOCAB, LONGEST = 61, 14


def _gpt2(dropout: float = 0.0) -> nn.Module:
    """A 2-layer GPT-2 from a config, no dropout (its random masks differ run to run), in
    float64: the attention's key bias gets a gradient that is zero in exact arithmetic, and
    AdamW scales float32's rounding noise there up to a visible step."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32, use_cache=False,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).double()


def _text_rows(n: int, seed: int) -> Batch:
    """Token sequences of 5 to 14 tokens, right-padded to 14: ``input_ids`` (0 after the
    end), ``attention_mask`` and ``labels`` (-100 after the end: not counted in the loss)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, LONGEST + 1, (n,), generator=g)
    ids = torch.randint(1, VOCAB, (n, LONGEST), generator=g)
    mask = (torch.arange(LONGEST)[None, :] < lengths[:, None]).long()
    return {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "labels": torch.where(mask.bool(), ids, -100),
    }


def _padded_to_longest(rows: list[Batch]) -> Batch:
    """A data collator that pads each batch to its own longest sequence (here: cuts the
    padding every row of the batch has), so batches come in different lengths."""
    batch = torch.utils.data.default_collate(rows)
    length = int(batch["attention_mask"].sum(1).max())
    return {k: v[:, :length] for k, v in batch.items()}


@dataclass(frozen=True)
class Case:
    """A model trained from dict batches: ``rows(n, seed)`` gives ``n`` rows of every column
    (the model's inputs and ``labels``); ``loss(outputs, labels)`` is the loss, or None where
    the model takes ``labels`` and returns its loss (``outputs["loss"]``); ``collate`` makes
    a batch of rows (None: stacked as they are)."""

    name: str
    build: Callable[[], nn.Module]  # the same weights on every call
    rows: Callable[[int, int], Batch]
    loss: Callable[[Any, torch.Tensor], torch.Tensor] | None
    pipeline_kwargs: tuple[tuple[str, Any], ...] = ()
    collate: Callable[[list[Batch]], Batch] | None = None


CASES = [
    Case("tagger", _tagger, _tagger_rows, _tagger_loss),
    # A loss inside the model from labels=, batches padded to their own longest sequence,
    # and (with Trainer) num_items_in_batch: the loss is summed over the batch's tokens.
    Case("gpt2", _gpt2, _text_rows, None, collate=_padded_to_longest),
]


def _inputs(case: Case, batch: Batch) -> Batch:
    """What the model is called with: the batch, less the labels where the loss is outside."""
    return {k: v for k, v in batch.items() if case.loss is None or k != "labels"}


def _loss(case: Case, model: nn.Module, batch: Batch) -> torch.Tensor:
    outputs = model(**_inputs(case, batch))
    return outputs["loss"] if case.loss is None else case.loss(outputs, batch["labels"])


def _pipeline(case: Case, model: nn.Module) -> fxpipe.Pipeline:
    example = _inputs(case, (case.collate or _stacked)(_items(case.rows(ROWS, seed=99))))
    return fxpipe.pipeline(
        model, (), DEVICES, chunks=2, example_kwargs=example, **dict(case.pipeline_kwargs)
    )


class Rows(Dataset[Batch]):
    """``STEPS`` batches of rows as dicts of tensors, one row per item."""

    def __init__(self, case: Case, extra: bool = False) -> None:
        self.columns = case.rows(ROWS * STEPS, seed=1)
        if extra:  # a column no model takes: Trainer must drop it
            self.columns["row_id"] = torch.arange(ROWS * STEPS)

    def __len__(self) -> int:
        return ROWS * STEPS

    def __getitem__(self, i: int) -> Batch:
        return {k: v[i] for k, v in self.columns.items()}


def _items(columns: Batch) -> list[Batch]:
    rows = len(next(iter(columns.values())))
    return [{k: v[i] for k, v in columns.items()} for i in range(rows)]


def _stacked(rows: list[Batch]) -> Batch:
    return torch.utils.data.default_collate(rows)  # type: ignore[no-any-return]


def _loader(case: Case) -> DataLoader[Batch]:
    return DataLoader(Rows(case), batch_size=ROWS, shuffle=False, collate_fn=case.collate)


def _assert_same_run(
    case: Case,
    got: list[torch.Tensor],
    want: list[torch.Tensor],
    model: nn.Module,
    eager: nn.Module,
) -> None:
    """Equal losses, step by step, and equal parameters after the steps (by the model's
    names); most parameters moved (one the loss never reaches may stay as it was)."""
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want)):
        assert relative_error(a, b) < TOLERANCE, f"step {step}: loss {a.item()} != {b.item()}"
    start = dict(case.build().named_parameters())
    trained = dict(model.named_parameters())
    assert trained.keys() == start.keys()
    for name, want_p in eager.named_parameters():
        assert relative_error(trained[name], want_p) < TOLERANCE, name
    moved = [k for k in trained if relative_error(trained[k], start[k]) > 1e-4]
    assert len(moved) > len(trained) / 2, f"only {moved} were trained"


def _twins(case: Case) -> tuple[fxpipe.Pipeline, nn.Module]:
    """A pipeline of one copy of the model, and another copy to run eagerly."""
    return _pipeline(case, case.build()), case.build()


# ------------------------------------------------------------------------------ the trainers

LR = 1e-2


def _hf_trainer(
    case: Case, model: nn.Module, out: Path, dataset: Dataset[Batch] | None = None, **args: Any
) -> tuple[Any, list[torch.Tensor]]:
    """A ``transformers.Trainer`` for ``STEPS`` steps on the CPU, and the list it will append
    the loss of each step to."""
    losses: list[torch.Tensor] = []

    class Recording(transformers.Trainer):  # type: ignore[misc]
        def compute_loss(self, *a: Any, **k: Any) -> Any:
            result = super().compute_loss(*a, **k)
            losses.append((result[0] if isinstance(result, tuple) else result).detach())
            return result

    def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> Any:
        assert case.loss is not None
        return case.loss(outputs, labels)

    settings: dict[str, Any] = dict(
        output_dir=str(out),
        use_cpu=True,
        report_to="none",
        max_steps=STEPS,
        per_device_train_batch_size=ROWS,
        learning_rate=LR,
        weight_decay=0.1,  # not on biases and norms: Trainer groups parameters by their names
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        label_names=["labels"],  # the labels column is kept although forward does not name it
        seed=0,
    )
    trainer = Recording(
        model=model,
        args=transformers.TrainingArguments(**{**settings, **args}),
        train_dataset=Rows(case) if dataset is None else dataset,
        compute_loss_func=None if case.loss is None else loss_func,
        data_collator=case.collate or transformers.default_data_collator,
    )
    return trainer, losses


def _accelerate(case: Case, model: nn.Module, **options: Any) -> list[torch.Tensor]:
    """``Accelerator.prepare(model, optimizer, loader)`` and a plain loop."""
    accelerator = accelerate.Accelerator(cpu=True, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader(case))
    losses = []
    for batch in loader:
        loss = _loss(case, model, batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def _fabric(case: Case, model: nn.Module) -> list[torch.Tensor]:
    """``Fabric.setup(model, optimizer)`` and a plain loop."""
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for batch in fabric.setup_dataloaders(_loader(case)):
        loss = _loss(case, model, batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


class Learner(lightning.LightningModule):  # type: ignore[misc]
    """A LightningModule holding the model (or its pipeline) as ``net``."""

    def __init__(self, case: Case, net: nn.Module) -> None:
        super().__init__()
        self.case = case
        self.net = net
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Batch, index: int) -> torch.Tensor:
        loss = _loss(self.case, self.net, batch)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


def _lightning(case: Case, learner: Learner) -> list[torch.Tensor]:
    """``lightning.pytorch.Trainer.fit`` on a LightningModule that holds the model."""
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(learner, _loader(case))
    return learner.losses


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps one process-wide state; each test starts from none."""
    yield
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


# ---------------------------------------------------------------------------------- tests

case_names = pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)


@case_names
def test_transformers_trainer_trains_pipeline_like_model(case: Case, tmp_path: Path) -> None:
    pipe, eager = _twins(case)
    trainer, got = _hf_trainer(case, pipe, tmp_path / "pipe")
    oracle, want = _hf_trainer(case, eager, tmp_path / "eager")
    # what Trainer learnt from the model: whether forward takes num_items_in_batch, the labels
    assert trainer.model_accepts_loss_kwargs == oracle.model_accepts_loss_kwargs
    assert trainer.label_names == oracle.label_names
    trainer.train()
    oracle.train()
    assert trainer.model is pipe
    _assert_same_run(case, got, want, pipe.module, eager)
    evaluated = trainer.evaluate(Rows(case))["eval_loss"]  # in eval mode, without grad
    assert not pipe.training
    assert abs(evaluated - oracle.evaluate(Rows(case))["eval_loss"]) < TOLERANCE * evaluated


def test_trainer_evaluates_a_model_with_dropout_in_eval_mode(tmp_path: Path) -> None:
    """GPT-2 with its default dropout: Trainer's evaluation (eval mode, no grad) gives the
    eager model's loss, every time; training steps draw dropout masks (the losses of two
    identical steps differ), as eager's do."""
    case = dataclasses.replace(CASES[1], build=lambda: _gpt2(dropout=0.1))
    pipe, eager = _twins(case)
    trainer, _ = _hf_trainer(case, pipe, tmp_path / "pipe")
    oracle, _ = _hf_trainer(case, eager, tmp_path / "eager")
    want = oracle.evaluate(Rows(case))["eval_loss"]
    for _ in range(2):
        assert abs(trainer.evaluate(Rows(case))["eval_loss"] - want) < TOLERANCE * want
    pipe.train()
    batch = _padded_to_longest(_items(case.rows(ROWS, seed=5)))
    first, second = (pipe(**batch).loss.item() for _ in range(2))
    assert first != second


def test_trainer_label_smoothing_shifts_a_causal_lms_labels(tmp_path: Path) -> None:
    """Trainer's label smoother shifts the labels of causal language models, which it tells
    by the model's class name: a pipeline of GPT-2 gets them shifted as GPT-2 does."""
    case = CASES[1]
    pipe, eager = _twins(case)
    trainer, got = _hf_trainer(case, pipe, tmp_path / "pipe", label_smoothing_factor=0.1)
    oracle, want = _hf_trainer(case, eager, tmp_path / "eager", label_smoothing_factor=0.1)
    trainer.train()
    oracle.train()
    _assert_same_run(case, got, want, pipe.module, eager)
    assert repr(pipe).startswith("Pipeline(")


@case_names
def test_accelerate_trains_pipeline_like_model(case: Case) -> None:
    pipe, eager = _twins(case)
    got = _accelerate(case, pipe)
    want = _accelerate(case, eager)
    _assert_same_run(case, got, want, pipe.module, eager)


@case_names
def test_fabric_trains_pipeline_like_model(case: Case) -> None:
    pipe, eager = _twins(case)
    got = _fabric(case, pipe)
    want = _fabric(case, eager)
    _assert_same_run(case, got, want, pipe.module, eager)


@case_names
def test_lightning_trainer_trains_pipeline_like_model(case: Case) -> None:
    pipe, eager = _twins(case)
    holder, oracle = Learner(case, pipe), Learner(case, eager)
    got = _lightning(case, holder)
    want = _lightning(case, oracle)
    _assert_same_run(case, got, want, pipe.module, eager)
    # A LightningModule's checkpoint holds the model's keys under the module's own name, so
    # the pipelined module's loads into the eager one and back (strictly).
    state = {k: v.clone() for k, v in holder.state_dict().items()}
    assert state.keys() == oracle.state_dict().keys()
    fresh = Learner(case, case.build())
    fresh.load_state_dict(state)
    holder.load_state_dict({k: v + 1 for k, v in state.items()})
    for name, value in state.items():
        assert torch.equal(fresh.state_dict()[name], value), name
        assert torch.equal(holder.state_dict()[name], value + 1), name


@case_names
def test_trainer_keeps_the_columns_forward_names(case: Case, tmp_path: Path) -> None:
    """Trainer keeps the dataset columns the model's forward names (and the labels), and
    drops the others, as for the model itself."""
    pipe, eager = _twins(case)
    extra = Rows(case, extra=True)
    trainer, _ = _hf_trainer(case, pipe, tmp_path / "pipe", extra, remove_unused_columns=True)
    oracle, _ = _hf_trainer(case, eager, tmp_path / "eager", extra, remove_unused_columns=True)
    got = next(iter(trainer.get_train_dataloader())).keys()
    want = next(iter(oracle.get_train_dataloader())).keys()
    named = {*inspect.signature(eager.forward).parameters, "labels"}
    assert set(got) == set(want) == named & set(extra.columns)
    assert "row_id" not in got


@case_names
def test_trainer_saves_what_loads_into_the_model_and_resumes(case: Case, tmp_path: Path) -> None:
    """Trainer's checkpoints of a pipeline hold the model's keys: the saved weights load into
    an eager copy with equal values, and a run resumed from the half-way checkpoint (a new
    pipeline) ends where the eager run does."""
    pipe, eager = _twins(case)
    saving = {"save_strategy": "steps", "save_steps": STEPS // 2}
    trainer, _ = _hf_trainer(case, pipe, tmp_path / "pipe", **saving)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    loaded = case.build()
    state = safetensors_torch().load_file(str(tmp_path / "final" / "model.safetensors"))
    loaded.load_state_dict(state)
    for name, value in pipe.module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name

    oracle, want = _hf_trainer(case, eager, tmp_path / "eager")
    oracle.train()
    again = _pipeline(case, case.build())
    resumed, got = _hf_trainer(case, again, tmp_path / "resumed", **saving)
    resumed.train(resume_from_checkpoint=str(tmp_path / "pipe" / f"checkpoint-{STEPS // 2}"))
    assert len(got) == STEPS - STEPS // 2
    _assert_same_run(case, want[: STEPS // 2] + got, want, again.module, eager)


def safetensors_torch() -> Any:
    return pytest.importorskip("safetensors.torch")


@case_names
def test_trainer_activation_checkpointing_is_the_pipelines(case: Case, tmp_path: Path) -> None:
    """``activation_checkpointing=True`` turns the pipeline's checkpointing to "always" (the
    run is the eager one's, which has no checkpointing); disabling restores the mode."""
    pipe, eager = _twins(case)
    assert pipe.checkpoint == "except_last" and not pipe.is_activation_checkpointing
    trainer, got = _hf_trainer(case, pipe, tmp_path / "pipe", activation_checkpointing=True)
    trainer.train()
    assert pipe.checkpoint == "always" and pipe.is_gradient_checkpointing
    oracle, want = _hf_trainer(case, eager, tmp_path / "eager")
    oracle.train()
    _assert_same_run(case, got, want, pipe.module, eager)
    pipe.gradient_checkpointing_disable()
    assert pipe.checkpoint == "except_last"


def test_activation_checkpointing_refuses_what_it_cannot_do() -> None:
    pipe = _pipeline(CASES[0], CASES[0].build())
    with pytest.raises(ConfigError, match="every_n_layers"):
        pipe.activation_checkpointing_enable(every_n_layers=2)
    with pytest.raises(ConfigError, match="offload"):
        pipe.gradient_checkpointing_enable(offload=True)
    with pytest.raises(ConfigError, match="preserve_rng_state"):
        pipe.activation_checkpointing_enable({"preserve_rng_state": False})
    assert pipe.checkpoint == "except_last"
    pipe.activation_checkpointing_enable({"use_reentrant": False})
    pipe.checkpoint = "never"  # set directly while enabled: disable goes back to the built mode
    pipe.activation_checkpointing_disable()
    assert pipe.checkpoint == "except_last"
    with pytest.raises(ConfigError, match="sometimes"):
        pipe.checkpoint = "sometimes"  # type: ignore[assignment]


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
    tagger = _pipeline(CASES[0], CASES[0].build())
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
