"""A small GPT-2 pipelined over two stages and trained by transformers' Trainer, by a plain
Accelerate loop and by Lightning's Trainer, each beside the same run on the eager model.

The loss is the model's own (``labels=``), batches are padded to their own longest sequence,
and Trainer evaluates in eval mode (the model's dropout off). Runs on the CPU in about a
minute; prints each run's last loss beside eager's and the largest parameter difference::

    python examples/trainers.py
"""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import accelerate
import lightning
import torch
import transformers
from torch.utils.data import DataLoader, default_collate

import fxpipe

VOCAB, LONGEST, ROWS, STEPS = 61, 14, 8, 4
DEVICES = ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cpu", "cpu"]


def gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip  (no dropout: its draws would differ between the two runs)
    return transformers.GPT2LMHeadModel(config).double()


def rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Sequences of 5 to 14 tokens, right-padded to 14; the padding's labels are -100."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, LONGEST + 1, (n,), generator=g)
    ids = torch.randint(1, VOCAB, (n, LONGEST), generator=g)
    mask = (torch.arange(LONGEST)[None, :] < lengths[:, None]).long()
    labels = torch.where(mask.bool(), ids, -100)
    return [
        {"input_ids": ids[i] * mask[i], "attention_mask": mask[i], "labels": labels[i]}
        for i in range(n)
    ]


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad each batch to its own longest sequence (cut the padding all its rows have)."""
    batch = default_collate(items)
    length = int(batch["attention_mask"].sum(1).max())
    return {k: v[:, :length] for k, v in batch.items()}


DATA = rows(ROWS * STEPS, seed=1)


def pipelined() -> fxpipe.Pipeline:
    model = gpt2()
    return fxpipe.pipeline(model, (), DEVICES, chunks=4, example_kwargs=collate(DATA[:ROWS]))


def with_trainer(model: torch.nn.Module) -> float:
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=ROWS,
        learning_rate=1e-3, report_to="none", save_strategy="no", logging_strategy="no",
        disable_tqdm=True, use_cpu=DEVICES[0] == "cpu", seed=0,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=DATA, eval_dataset=DATA, data_collator=collate
    )
    trainer.train()
    return float(trainer.evaluate()["eval_loss"])


def with_accelerate(model: torch.nn.Module) -> float:
    accelerator = accelerate.Accelerator(cpu=DEVICES[0] == "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(DATA, batch_size=ROWS, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return float(loss)


class Learner(lightning.LightningModule):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net
        self.last = 0.0

    def training_step(self, batch: dict[str, torch.Tensor], index: int) -> Any:
        loss = self.net(**batch).loss
        self.last = float(loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def with_lightning(model: torch.nn.Module) -> float:
    learner = Learner(model)
    trainer = lightning.Trainer(
        accelerator="cpu" if DEVICES[0] == "cpu" else "cuda", devices=1, max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(learner, DataLoader(DATA, batch_size=ROWS, collate_fn=collate))
    return learner.last


def main() -> None:
    for name, run in [("Trainer", with_trainer), ("Accelerate", with_accelerate),
                      ("Lightning", with_lightning)]:  # fmt: skip
        pipe = pipelined()
        eager = copy.deepcopy(gpt2())
        got, want = run(pipe), run(eager)
        trained = dict(pipe.module.named_parameters())
        diff = max((trained[k] - p).abs().max().item() for k, p in eager.named_parameters())
        print(f"{name:10s} loss {got:.6f} (eager {want:.6f}); parameters differ by {diff:.1e}")
        assert abs(got - want) <= 1e-6 * abs(want) and diff < 1e-6, name


if __name__ == "__main__":
    main()
