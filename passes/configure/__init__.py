"""Configure: the run a plan is for (micro-batches, checkpointing per stage) chosen with its
split, from the step time the cost model predicts under the memory budgets."""
