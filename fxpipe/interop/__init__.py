"""Interop: how a pipeline stands where its model stood in other tools (transformers'
Trainer, Accelerate, Lightning)."""
