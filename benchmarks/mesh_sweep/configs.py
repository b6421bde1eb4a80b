"""The mesh sweep's configurations: five schedules on a 2 x 2 mesh, and the layouts (the
pipeline alone, pipeline x data, pipeline x tensor parallel) with their replicas and lengths;
the groups ``--meshes`` names."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from benchmarks.harness.models.hf_text import LENGTH

__all__ = ["SHORT", "Config", "SCHEDULES", "LAYOUTS", "CONFIGS", "GROUPS", "configs_for"]

#: The second step's sequence length in the layouts: shorter than the example's and odd
#: (an uneven share of the tokens on each tp rank; a window of 4 shorter than both).
SHORT = 7


@dataclass(frozen=True)
class Config:
    """One way to run the sweep: torch's schedule, stages per rank, the data parallelism,
    the micro-batches per replica, the mesh (``shape``: (pp, dp) or (pp, dp, tp); (pp,):
    no mesh, the pipeline's ranks alone), the rows per replica (None: the model's example
    batch, repeated when short) and each step's sequence length (empty: one step at the
    example's)."""

    schedule: str
    stages_per_rank: int
    data_parallel: str
    n_microbatches: int
    shape: tuple[int, ...] = (2, 2)
    rows: int | None = None
    lengths: tuple[int, ...] = ()

    @property
    def pp(self) -> int:
        return self.shape[0]

    @property
    def dp(self) -> int:
        return self.shape[1] if len(self.shape) > 1 else 1

    @property
    def tp(self) -> int:
        return self.shape[2] if len(self.shape) > 2 else 1

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    @property
    def name(self) -> str:
        """``schedule/data_parallel`` (the five on 2 x 2), else the mesh first
        (``pp2xdp1xtp2/1f1b``), the data parallelism where there are replicas."""
        if self.rows is None:
            return f"{self.schedule}/{self.data_parallel}"
        mesh = "x".join(f"{d}{n}" for d, n in zip(("pp", "dp", "tp"), self.shape))
        return f"{mesh}/{self.schedule}" + (f"/{self.data_parallel}" if self.dp > 1 else "")


#: The schedules on a 2 x 2 mesh, one step at the model's example batch (each config's
#: micro-batches the fewest the schedule accepts on 2 ranks).
SCHEDULES = (
    Config("gpipe", 1, "ddp", 2),
    Config("1f1b", 1, "fsdp", 2),
    Config("loopedbfs", 2, "ddp", 2),
    Config("interleaved1f1b", 2, "fsdp", 2),
    Config("zbvzerobubble", 2, "fsdp", 4),  # zero bubble: FSDP only (DDP misses W passes)
)
_STEPS = (LENGTH, SHORT)
#: The layouts, two steps each (12 tokens, then 7), replicas of 2, 4 and 8 sequences.
LAYOUTS = (
    Config("1f1b", 1, "ddp", 2, shape=(2,), rows=4, lengths=_STEPS),
    Config("gpipe", 1, "ddp", 2, shape=(2, 2), rows=2, lengths=_STEPS),
    Config("1f1b", 1, "fsdp", 2, shape=(2, 2), rows=4, lengths=_STEPS),
    Config("gpipe", 1, "ddp", 2, shape=(1, 1, 2), rows=2, lengths=_STEPS),
    Config("1f1b", 1, "ddp", 4, shape=(2, 1, 2), rows=8, lengths=_STEPS),
)
CONFIGS = SCHEDULES + LAYOUTS
#: What ``--meshes`` names.
GROUPS: dict[str, tuple[Config, ...]] = {
    "schedules": SCHEDULES,
    "layouts": LAYOUTS,
    "pp": tuple(c for c in LAYOUTS if c.dp == c.tp == 1),
    "dp": tuple(c for c in LAYOUTS if c.dp > 1),
    "tp": tuple(c for c in LAYOUTS if c.tp > 1),
    "all": CONFIGS,
}


def configs_for(name: str, count: int, configs: tuple[Config, ...]) -> list[Config]:
    """``count`` of ``configs`` (all when ``count >= len(configs)``), starting at one fixed
    per model name, so that a sweep over many models covers each about equally."""
    if count >= len(configs):
        return list(configs)
    start = zlib.crc32(name.encode()) % len(configs)
    return [configs[(start + i) % len(configs)] for i in range(count)]
