"""A pipeline trained by transformers.Trainer, accelerate.Accelerator and Lightning (Fabric and
the Lightning Trainer), each compared with the same trainer on an eager copy of the model:
the loss of every step and every parameter after the steps are equal.

A case is a model, a batch maker and where the loss comes from (a function of the outputs
and the labels, or the model's own output); each trainer test runs over ``CASES``
(trainer_cases.py). What a tool reads of the pipeline itself: test_trainers_dropin.py.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset
from trainer_cases import (
    CASES,
    ROWS,
    STEPS,
    TOLERANCE,
    Batch,
    Case,
    Rows,
    assert_same_run,
    case_loader,
    case_pipeline,
    gpt2,
    items_of,
    padded_to_longest,
    step_loss,
    twins,
)

from fxpipe.errors import ConfigError

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
lightning = pytest.importorskip("lightning")

pytestmark = pytest.mark.usefixtures("one_thread")

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
    model, optimizer, loader = accelerator.prepare(model, optimizer, case_loader(case))
    losses = []
    for batch in loader:
        loss = step_loss(case, model, batch)
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
    for batch in fabric.setup_dataloaders(case_loader(case)):
        loss = step_loss(case, model, batch)
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
        loss = step_loss(self.case, self.net, batch)
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
    trainer.fit(learner, case_loader(case))
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
    pipe, eager = twins(case)
    trainer, got = _hf_trainer(case, pipe, tmp_path / "pipe")
    oracle, want = _hf_trainer(case, eager, tmp_path / "eager")
    # what Trainer learnt from the model: whether forward takes num_items_in_batch, the labels
    assert trainer.model_accepts_loss_kwargs == oracle.model_accepts_loss_kwargs
    assert trainer.label_names == oracle.label_names
    trainer.train()
    oracle.train()
    assert trainer.model is pipe
    assert_same_run(case, got, want, pipe.module, eager)
    evaluated = trainer.evaluate(Rows(case))["eval_loss"]  # in eval mode, without grad
    assert not pipe.training
    assert abs(evaluated - oracle.evaluate(Rows(case))["eval_loss"]) < TOLERANCE * evaluated


def test_trainer_evaluates_a_model_with_dropout_in_eval_mode(tmp_path: Path) -> None:
    """GPT-2 with its default dropout: Trainer's evaluation (eval mode, no grad) gives the
    eager model's loss, every time; training steps draw dropout masks (the losses of two
    identical steps differ), as eager's do."""
    case = dataclasses.replace(CASES[1], build=lambda: gpt2(dropout=0.1))
    pipe, eager = twins(case)
    trainer, _ = _hf_trainer(case, pipe, tmp_path / "pipe")
    oracle, _ = _hf_trainer(case, eager, tmp_path / "eager")
    want = oracle.evaluate(Rows(case))["eval_loss"]
    for _ in range(2):
        assert abs(trainer.evaluate(Rows(case))["eval_loss"] - want) < TOLERANCE * want
    pipe.train()
    batch = padded_to_longest(items_of(case.rows(ROWS, seed=5)))
    first, second = (pipe(**batch).loss.item() for _ in range(2))
    assert first != second


def test_trainer_label_smoothing_shifts_a_causal_lms_labels(tmp_path: Path) -> None:
    """Trainer's label smoother shifts the labels of causal language models, which it tells
    by the model's class name: a pipeline of GPT-2 gets them shifted as GPT-2 does."""
    case = CASES[1]
    pipe, eager = twins(case)
    trainer, got = _hf_trainer(case, pipe, tmp_path / "pipe", label_smoothing_factor=0.1)
    oracle, want = _hf_trainer(case, eager, tmp_path / "eager", label_smoothing_factor=0.1)
    trainer.train()
    oracle.train()
    assert_same_run(case, got, want, pipe.module, eager)
    assert repr(pipe).startswith("Pipeline(")


@case_names
def test_accelerate_trains_pipeline_like_model(case: Case) -> None:
    pipe, eager = twins(case)
    got = _accelerate(case, pipe)
    want = _accelerate(case, eager)
    assert_same_run(case, got, want, pipe.module, eager)


@case_names
def test_fabric_trains_pipeline_like_model(case: Case) -> None:
    pipe, eager = twins(case)
    got = _fabric(case, pipe)
    want = _fabric(case, eager)
    assert_same_run(case, got, want, pipe.module, eager)


@case_names
def test_lightning_trainer_trains_pipeline_like_model(case: Case) -> None:
    pipe, eager = twins(case)
    holder, oracle = Learner(case, pipe), Learner(case, eager)
    got = _lightning(case, holder)
    want = _lightning(case, oracle)
    assert_same_run(case, got, want, pipe.module, eager)
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
    pipe, eager = twins(case)
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
    pipe, eager = twins(case)
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
    again = case_pipeline(case, case.build())
    resumed, got = _hf_trainer(case, again, tmp_path / "resumed", **saving)
    resumed.train(resume_from_checkpoint=str(tmp_path / "pipe" / f"checkpoint-{STEPS // 2}"))
    assert len(got) == STEPS - STEPS // 2
    assert_same_run(case, want[: STEPS // 2] + got, want, again.module, eager)


def safetensors_torch() -> Any:
    return pytest.importorskip("safetensors.torch")


@case_names
def test_trainer_activation_checkpointing_is_the_pipelines(case: Case, tmp_path: Path) -> None:
    """``activation_checkpointing=True`` turns the pipeline's checkpointing to "always" (the
    run is the eager one's, which has no checkpointing); disabling restores the mode."""
    pipe, eager = twins(case)
    assert pipe.checkpoint == "except_last" and not pipe.is_activation_checkpointing
    trainer, got = _hf_trainer(case, pipe, tmp_path / "pipe", activation_checkpointing=True)
    trainer.train()
    assert pipe.checkpoint == "always" and pipe.is_gradient_checkpointing
    oracle, want = _hf_trainer(case, eager, tmp_path / "eager")
    oracle.train()
    assert_same_run(case, got, want, pipe.module, eager)
    pipe.gradient_checkpointing_disable()
    assert pipe.checkpoint == "except_last"


def test_activation_checkpointing_refuses_what_it_cannot_do() -> None:
    pipe = case_pipeline(CASES[0], CASES[0].build())
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
