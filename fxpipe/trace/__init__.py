"""Front end: captures a model as one flat GraphModule (torch.fx, else torch.export) and
checks what micro-batching changes for it.

``tracing.trace`` is the entry point; the other modules are its parts: binding a call's
arguments to placeholders, refusing constructs a pipeline cannot split (custom autograd
Functions that export would mis-differentiate, in-place writes through aliases), copying
shape queries and input-derived values to each reader, and one error per failed tracer.
"""
