"""Tensor parallelism planned from the graph: which matrix products of a stage are cut by
output features (column-wise) and which by input features (row-wise, then all-reduced),
which embeddings and LM heads are cut over the vocabulary, and why the rest stays whole; and
the program each tp rank runs by that plan (``local.py``), cut by torch's own tensor
parallelism (``parallelize.py``)."""
