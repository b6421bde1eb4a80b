"""Small models for timing one training step, each with a batch and a loss: a ResNet-like
CNN, a GPT-2 decoder and a BERT encoder from transformers configs (their losses inside the
model), shared by the compile and autoconfig benchmarks; and a chain of tiny products, whose
compute is negligible, for measuring a runtime's fixed costs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "Batch", "Loss", "SmallResNet", "TinyProducts", "BATCH", "LENGTH"]

BATCH, LENGTH = 16, 64

#: (positional arguments, keyword arguments) of one call.
Batch = tuple[tuple[Any, ...], dict[str, Any]]
#: The model's output -> the loss to differentiate.
Loss = Callable[[Any], torch.Tensor]


class TinyProducts(nn.Module):
    """``layers`` products of 4 features, each followed by ``activation``: every node, stage
    pass and message costs its fixed time alone (the autoconfig benchmarks' calibrations)."""

    def __init__(
        self, layers: int, activation: Callable[[torch.Tensor], torch.Tensor] = torch.relu
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(layers))
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.activation(layer(x))
        return x


class _Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = (
            nn.Identity()
            if stride == 1 and c_in == c_out
            else nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.skip(x))


class SmallResNet(nn.Module):
    """Four residual blocks of 3x3 convolutions, BatchNorm and ReLU over 32x32 images."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width))
        self.blocks = nn.Sequential(
            _Block(width, width, 1),
            _Block(width, 2 * width, 2),
            _Block(2 * width, 2 * width, 1),
            _Block(2 * width, 4 * width, 2),
        )
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(F.relu(self.stem(x)))
        return self.head(h.mean(dim=(2, 3)))


def _cnn() -> tuple[nn.Module, Batch, Loss]:
    # a cross-entropy against class 0: no labels to split with the micro-batches by hand
    return SmallResNet(), ((torch.randn(BATCH, 3, 32, 32),), {}), _class_zero


def _class_zero(out: torch.Tensor) -> torch.Tensor:
    return (out.logsumexp(dim=-1) - out[:, 0]).mean()


def _text_batch(vocab: int, labels: torch.Tensor | None = None) -> dict[str, Any]:
    ids = torch.randint(1, vocab, (BATCH, LENGTH))
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, LENGTH - 9 :] = 0  # one padded sequence
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, -100) if labels is None else labels,
    }


def _decoder() -> tuple[nn.Module, Batch, Loss]:
    import transformers

    config = transformers.GPT2Config(
        n_layer=4, n_embd=128, n_head=4, vocab_size=2000, n_positions=128, use_cache=False,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config), ((), _text_batch(2000)), lambda out: out.loss


def _encoder() -> tuple[nn.Module, Batch, Loss]:
    import transformers

    config = transformers.BertConfig(
        num_hidden_layers=4, hidden_size=128, intermediate_size=512, num_attention_heads=4,
        vocab_size=2000, max_position_embeddings=128, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0, num_labels=4,
    )  # fmt: skip
    batch = _text_batch(2000, labels=torch.randint(0, 4, (BATCH,)))
    model = transformers.BertForSequenceClassification(config)
    return model, ((), batch), lambda out: out.loss


MODELS: dict[str, Callable[[], tuple[nn.Module, Batch, Loss]]] = {
    "cnn": _cnn,
    "decoder": _decoder,
    "encoder": _encoder,
}
