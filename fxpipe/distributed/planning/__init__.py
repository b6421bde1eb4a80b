"""Planning before any rank runs: the layouts a model may take over the ranks and what each
costs (``layout``, ``priced``, ``estimate``, ``table``, ``tensor_costs``), the schedule and
micro-batches ``"auto"`` picks (``auto``), the tensor-parallel plan over the mesh's ``"tp"``
dimension (``tensor_parallel``), and what the ranks share while they plan (``agreement``)."""
