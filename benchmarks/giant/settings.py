"""The giant benchmark's settings: batch, micro-batches, devices, budgets and targets."""

from __future__ import annotations

from fxpipe.ir import CheckpointMode

BATCH, TOKENS = 16, 1024
CHUNKS = 16
STAGES = 4
CHECKPOINT: CheckpointMode = "except_last"
DEVICE_NAMES = [f"cuda:{i}" for i in range(STAGES)]
RATIOS = (4.0, 2.0, 1.5, 1.25, 1.1, 1.05, 1.0, 0.98)
#: Relative precision of the bisections on the budget (the training floor's: 1%).
TOLERANCE = 1e-3
TRAINING_TOLERANCE = 1e-2
TARGET_BOTTLENECK = 1.01
TARGET_SPEEDUP = 2.5
TARGET_SEARCH_S = 2.0
GIB = 2.0**30
