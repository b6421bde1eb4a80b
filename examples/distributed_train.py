"""Train a small non-Sequential model on torch.distributed.pipelining with an fxpipe plan.

    torchrun --nproc-per-node 2 examples/distributed_train.py [--schedule 1f1b] [--steps 5]
    torchrun --nproc-per-node 4 examples/distributed_train.py --pp 2 --dp 2 [--save DIR]
    torchrun --nproc-per-node 4 examples/distributed_train.py --pp 2 --dp 2 --data-parallel fsdp

One process per stage: gloo on CPU, NCCL (one GPU per process) when CUDA is available.
Every rank builds the same model and calls ``pipeline_schedule``; fxpipe traces it, splits
it into balanced stages (the long skip from the stem to the head is relayed through the
stages in between) and keeps on each rank only its own stage's parameters. With ``--dp``,
the ranks form a ``(pp, dp)`` mesh: ``dp`` pipeline replicas, each fed its slice of the
global batch, whose stages average gradients with DDP (``--data-parallel fsdp``: FSDP2,
each replica holding a shard of every parameter). The last rank of each replica prints
the loss of each step; at the end the first replica's rank 0 gathers its shards into one
state dict and checks it in the plain, unpipelined model, and ``--save`` writes one
``torch.distributed.checkpoint`` for the whole job (loadable at another layout).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fxpipe.distributed as fd

CLASSES, FEATURES, WIDTH = 10, 32, 128


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
    """A stem whose features skip over every block to the head; returns a dict."""

    def __init__(self, depth: int = 8) -> None:
        super().__init__()
        self.stem = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(depth))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(2 * WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h0 = self.stem(x)
        h = h0
        for block in self.blocks:
            h = block(h)
        features = self.norm(h)
        return {"logits": self.head(torch.cat([features, h0], dim=-1)), "features": features}


def loss_fn(out: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of one micro-batch (so the schedule scales gradients)."""
    return F.cross_entropy(out["logits"], target)


def batch(step: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same synthetic batch on every rank: a fixed random teacher labels random inputs."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))
    return x.to(device), (x @ teacher).argmax(-1).to(device)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="fxpipe plan on torch.distributed.pipelining")
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved1f1b, ...")
    parser.add_argument("--stages-per-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--pp", type=int, default=None, help="pipeline ranks (default: all)")
    parser.add_argument("--dp", type=int, default=1, help="pipeline replicas")
    parser.add_argument("--data-parallel", default="ddp", help="ddp or fsdp (with --dp)")
    parser.add_argument("--save", default=None, help="folder for a distributed checkpoint")
    return parser.parse_args()


def init_process_group() -> torch.device:
    """NCCL and this process's GPU when CUDA is available, else gloo on the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        return torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo")
    return torch.device("cpu")


def pp_dp_mesh(pp: int, dp: int, device: torch.device) -> tuple[Any, int]:
    """A ``(pp, dp)`` mesh and this rank's replica (None and 0: one pipeline over all ranks)."""
    if dp == 1 and pp == dist.get_world_size():
        return None, 0
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
    return mesh, mesh.get_local_rank("dp")


def train_step(
    pipe: fd.DistributedPipeline,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
) -> float | None:
    """One step of the schedule and the optimizer; the mean micro-batch loss on the last
    stage's rank (None elsewhere)."""
    losses: list[torch.Tensor] = []
    if pipe.is_first:
        pipe.schedule.step(x, target=y if pipe.is_last else None, losses=losses)
    elif pipe.is_last:
        pipe.schedule.step(target=y, losses=losses)
    else:
        pipe.schedule.step()
    pipe.sync_tied_gradients()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.stack(losses).mean().item() if pipe.is_last else None


def main() -> None:
    opts = parse_args()
    device = init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh, replica = pp_dp_mesh(opts.pp or world // opts.dp, opts.dp, device)

    def my_slice(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's rows of the global batch of ``step``."""
        x, y = batch(step, opts.batch * opts.dp, device)
        return x.chunk(opts.dp)[replica], y.chunk(opts.dp)[replica]

    torch.manual_seed(0)  # the same weights on every rank
    model = SkipNet()
    x, y = my_slice(0)
    pipe = fd.pipeline_schedule(
        model,
        x.cpu(),
        schedule=opts.schedule,
        n_microbatches=opts.microbatches,
        stages_per_rank=opts.stages_per_rank,
        loss_fn=loss_fn,
        scale_grads=True,
        device=device,
        mesh=mesh,
        data_parallel=opts.data_parallel,
    )
    if rank == 0:
        print(pipe.plan.summary(), flush=True)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)

    for step in range(opts.steps):
        loss = train_step(pipe, optimizer, *my_slice(step))
        if loss is not None:
            where = f"rank {rank}, replica {replica}, stages {pipe.stage_indices}"
            print(f"step {step}: loss {loss:.4f} ({where})")

    if opts.save:
        pipe.save_checkpoint(opts.save, optimizer)
        if rank == 0:
            print(f"saved a distributed checkpoint to {opts.save}")
    state = pipe.gather_state_dict(dst=0)  # within each replica's pipeline
    if state is not None and replica == 0:
        plain = SkipNet()
        plain.load_state_dict(state, strict=True)
        x, y = batch(opts.steps, opts.batch, torch.device("cpu"))
        with torch.no_grad():
            held_out = loss_fn(plain(x), y).item()
        print(f"merged checkpoint: {len(state)} tensors, held-out loss {held_out:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
