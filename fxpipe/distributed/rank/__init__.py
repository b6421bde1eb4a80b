"""One rank's runtime: its stages as torch's schedules run them (``runner``, ``stage``), the
shapes and memory layouts of what it sends and receives (``shapes``, ``step_shapes``,
``strides``), a zero-bubble stage's weight gradients (``split_backward``), gradients of the
Parameters several ranks hold (``gradients``, ``tied_guard``) and its checkpoint shard
(``checkpoint``)."""
