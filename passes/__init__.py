"""fxpipe's compile-time passes: pure functions from a traced graph to data or a new graph.

Installed as ``fxpipe.passes``; import it only under that name. A folder per step, in order:

1. ``price``: ``estimate.estimate_costs(gm, example_values, *, mode) -> CostTable`` prices
   every node: the default ``roofline`` (its per-op facts in ``op_work``), read from the
   shapes torch.export ``recorded`` where it can, or ``timing`` by profiling.
2. ``partition``: ``cost_graph.to_networkx(gm, costs)`` (node weight = cost, edge = bytes),
   ``units.build_units`` (groups no border may split), then ``search.partition_graph(g, k,
   *, slack, speed, memory) -> Partition``: exact over convex splits (``exact`` on
   ``ideals``) when small, else over several orders (``orders``, ``chain_dp``, re-placed in
   ``windows``); ``objective`` counts the bottleneck and the bytes, ``fit`` and
   ``budgeted`` add speeds and memory budgets, ``memory`` and ``memory_tables`` price a
   stage's memory.
3. ``split``: ``plan.build_plan(...) -> PipelinePlan``, ``codegen.split_stages(plan,
   output_spec, *, traffic) -> StageProgram`` (``placement`` points device constants at
   each stage's device), and ``follow.follow_borders`` for another trace of the same model.
4. ``batch`` (between trace and price): ``roles.batch_roles`` says which values grow with
   the batch, ``grouping.row_grouping`` tells a computation that only groups the batch's
   rows (a Mixture-of-Experts layer's tokens sorted by expert) from one that mixes them,
   ``mixing.check_no_batch_mixing`` refuses a reduction read back per sample, and
   ``reductions.split_reductions`` computes a loss inside the model from partial sums per
   micro-batch (the partial forms ``losses`` knows).
5. ``configure`` (over 1 to 3): ``step_time.predict_step`` replays the clock-cycle schedule
   on a plan's stage costs (bubble, shared devices, recomputation, the runtime's costs),
   and ``choose.choose_configuration(planner, counts, modes, ...)`` keeps the fastest
   configuration that fits, with checkpoint modes per stage (``least_recompute``).
6. ``tensor`` (beside split): ``plan.tensor_plan(gm, tp, example_values, *, stage_of) ->
   TensorPlan`` finds how each stage's products are cut over tp ranks: ``products`` finds
   the products against a parameter and the embeddings, ``layouts`` (with ``cuts`` and
   ``reshapes``) follows a cut through one op, ``search`` groups column- and row-wise
   products to a fixed point, ``assembly`` makes the ``records`` (shapes from ``values``).

Beside them, the shared facts about ops: ``ops`` (views, in-place writes, state changes)
and ``shape_only`` (modules whose output is shaped like their input).

The contract every pass keeps: inputs are not mutated (the GraphModule, its graph and
the user's modules are left as they were), options are keyword-only, outputs are frozen
records from ``fxpipe.ir`` (the tensor-parallel plan's from ``tensor.records``). Passes
import torch, torch.fx, networkx, numpy, ``fxpipe.ir``, ``fxpipe.errors`` and
``fxpipe.model_state`` (which puts back what pricing runs change) only; never the runtime,
the tracer or the front door.
"""

__all__: list[str] = []
