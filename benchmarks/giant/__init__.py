"""The giant benchmark: memory budgets on Llama-7B's and GPT-2 XL's shapes, fxpipe's
budgeted partitioner against Accelerate's device maps."""
