"""Batch: what micro-batching means for a graph: which values grow with the batch, and the
reductions over it (a loss inside the model) computed from partial sums."""
