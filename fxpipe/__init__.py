"""fxpipe: pipeline any PyTorch model across devices, with no change to the model or loop.

    pipe = fxpipe.pipeline(model, example_input, ["cuda:0", "cuda:1"], chunks=8)
    loss = criterion(pipe(x), y); loss.backward(); opt.step()

How a model becomes a pipeline, one direction of flow:

1. ``tracing``: torch.fx captures the model (torch.export when fx cannot) as a flat graph
   whose placeholders are the input values and whose output is a flat tuple.
2. ``passes.cost_model``: every node is priced (profiled time, analytic FLOPs, or
   parameter bytes) together with the bytes of its output.
3. ``passes.nx_graph`` / ``passes.units`` / ``passes.partition``: the graph becomes a
   networkx DAG, is coarsened into groups no border may split, and is cut into K convex
   stages with the smallest bottleneck (exactly, over every convex split, when the graph
   is small enough; exactly on several topological orders otherwise), then the fewest
   boundary bytes within a slack.
4. ``passes.plan`` / ``passes.split_stages``: a frozen ``PipelinePlan`` (``print(plan)``
   shows it) and one GraphModule per stage whose inputs and outputs are exactly the
   boundary values; modules and parameters stay the user's own objects.
5. ``runtime``: micro-batches flow through the stages on a clock-cycle schedule, one
   worker thread per device, copy streams for boundary values, fork/join so backward runs
   in reverse micro-batch order, and checkpoint/recompute with the RNG state restored.

``fxpipe.Pipeline`` is the ``nn.Module`` that puts it together: same outputs, same
gradients, same parameters, same ``state_dict`` keys as the model it was built from.
``plan.draw()`` pictures a plan, ``fxpipe.record(pipe)`` times every task of a step, and the
``fxpipe inspect`` command does both for any model factory.
"""

from fxpipe.api import pipeline, plan
from fxpipe.errors import FxPipeError
from fxpipe.ir import PipelinePlan
from fxpipe.pipeline import Pipeline
from fxpipe.timeline import Timeline, record

__all__ = ["pipeline", "plan", "record", "Pipeline", "PipelinePlan", "Timeline", "FxPipeError"]
__version__ = "0.1.0"
