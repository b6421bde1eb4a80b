"""fxpipe's compile-time passes: pure functions from a traced graph to data or a new graph.

Installed as ``fxpipe.passes``; import it only under that name. In order:

1. ``cost_model.estimate_costs(gm, example_values, *, mode) -> CostTable``: prices nodes.
2. ``nx_graph.to_networkx(gm, costs) -> nx.DiGraph``: node weight = cost, edge = bytes.
3. ``units.build_units(g) -> Units``: groups that no stage border may split.
4. ``partition.partition_graph(g, num_stages, *, slack) -> Partition``: the split
   (``ideal_search`` is the exact search for small graphs, on the ideal-lattice DP of
   ``ideals``; ``order_search`` splits candidate orders exactly with ``dp``, refines them
   and re-places their borders on the coarse DAG of ``windows``; ``objective`` counts the
   bottleneck and the bytes sent; ``fit`` and ``budgeted`` add device speeds and memory
   budgets, ``memory`` models a stage's training memory and ``memory_tables`` prices it
   inside the search).
5. ``plan.build_plan(gm, costs, g, partition, devices, *, chunks) -> PipelinePlan``.
6. ``split_stages.split_stages(plan, output_spec, *, traffic) -> StageProgram``: codegen
   (``placement`` points each stage's device constants, which ``torch.export`` records, at
   the stage's device; ``ops`` says what each op is: view, in-place write).

The contract every pass keeps: inputs are not mutated (the GraphModule, its graph and
the user's modules are left as they were), options are keyword-only, outputs are frozen
records from ``fxpipe.ir``. Passes import torch, torch.fx, networkx, numpy, ``fxpipe.ir``,
``fxpipe.errors`` and ``fxpipe.model_state`` (which puts back what pricing runs change)
only; never the runtime.
"""

__all__: list[str] = []
