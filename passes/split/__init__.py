"""Split: a partition made a PipelinePlan, and the plan made one GraphModule per stage (or
another trace of the model split along a plan's borders)."""
