"""fxpipe: pipeline any PyTorch model across devices, with no change to the model or loop.

    pipe = fxpipe.pipeline(model, example_input, ["cuda:0", "cuda:1"], chunks=8)
    loss = criterion(pipe(x), y); loss.backward(); opt.step()

How a model becomes a pipeline, one direction of flow (the folders, in order):

1. trace (``fxpipe/trace/``): torch.fx captures the model (torch.export when fx cannot) as
   a flat graph whose placeholders are the input values and whose output is a flat tuple.
2. price (``passes/cost_model.py``, installed as ``fxpipe.passes``): every node gets a
   cost (an analytic roofline by default; profiled time, FLOPs or parameter bytes on
   request) and the bytes of its output.
3. partition (``passes/nx_graph.py``, ``units.py``, ``partition.py``): the graph becomes a
   networkx DAG, is coarsened into groups no border may split, and is cut into K convex
   stages with the smallest bottleneck, then the fewest boundary bytes within a slack.
4. split (``passes/plan.py``, ``split_stages.py``): a frozen ``PipelinePlan`` and one
   GraphModule per stage whose inputs and outputs are exactly the boundary values.
5. run (``fxpipe/runtime/``): micro-batches flow through the stages on a clock-cycle
   schedule, one worker thread per device, copy streams for boundary values, fork/join so
   backward runs in reverse micro-batch order, and checkpoint/recompute with the RNG state
   restored; ``fxpipe/distributed/`` runs the same plan one process per stage.
6. view (``fxpipe/views/``): ``print(plan)``, ``plan.draw()``, ``fxpipe.record(pipe)`` and
   the ``fxpipe inspect`` command.

The glue sits at the top: ``api`` (``fxpipe.plan``, ``fxpipe.pipeline``), ``pipeline``
(``fxpipe.Pipeline``, the ``nn.Module`` with the model's outputs, gradients, parameters and
``state_dict`` keys), ``ir`` (the frozen records between the steps), ``materialise``
(a model built on ``meta``, made straight on its stages' devices), ``loading``
(``fxpipe.load_checkpoint``, a checkpoint streamed into the stages shard by shard),
``errors``, ``devices`` and ``progress``.
"""

from fxpipe.api import pipeline, plan
from fxpipe.errors import FxPipeError
from fxpipe.ir import PipelinePlan
from fxpipe.loading import load_checkpoint
from fxpipe.pipeline import Pipeline
from fxpipe.views.timeline import Timeline, record

__all__ = [
    "pipeline",
    "plan",
    "record",
    "load_checkpoint",
    "Pipeline",
    "PipelinePlan",
    "Timeline",
    "FxPipeError",
]
__version__ = "0.1.0"
