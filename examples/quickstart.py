"""Pipeline a small non-Sequential model over the devices present and train it.

Runs on every CUDA GPU there is (one stage each, at least two), else on four CPU stages.
Prints the plan, trains a few steps with an optimizer created before ``pipeline()``, and
checks the pipelined loss and gradients against the same model run eagerly.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


class Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class SkipNet(nn.Module):
    """An encoder whose first features skip to the head, with a tied input/output weight."""

    def __init__(self, vocab: int = 512, width: int = 128, depth: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, *, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        h0 = self.embed(tokens) * mask.unsqueeze(-1)
        h = h0
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h + h0))
        return {"logits": logits, "features": h}


def main() -> None:
    torch.manual_seed(0)
    if torch.cuda.device_count() >= 2:
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    else:
        devices = ["cpu"] * 4
    device = torch.device(devices[0])
    model = SkipNet().to(device)
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 512, (32, 64), device=device)
    mask = (torch.rand(32, 64, device=device) > 0.1).float()
    target = torch.randint(0, 512, (32, 64), device=device)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # made before pipeline(): still works
    pipe = fxpipe.pipeline(model, tokens, devices, example_kwargs={"mask": mask}, chunks=8)
    print(pipe.plan.summary(), end="\n\n")

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        start = time.perf_counter()
        out = pipe(tokens, mask=mask)
        loss = F.cross_entropy(out["logits"].flatten(0, 1), target.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        ref_out = reference(tokens, mask=mask)
        ref_loss = F.cross_entropy(ref_out["logits"].flatten(0, 1), target.flatten())
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        print(
            f"step {step}: loss {loss.item():.5f} (eager {ref_loss.item():.5f}), "
            f"{elapsed * 1e3:.0f} ms"
        )
    worst = max(
        (p.detach().cpu() - r.detach().cpu()).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters())
    )
    print(f"largest parameter difference from eager after 3 steps: {worst:.2e}")


if __name__ == "__main__":
    main()
