"""Weights: a model built on ``meta`` made on its stages' devices, and checkpoints streamed
into the stages shard by shard."""
