"""fxpipe: pipeline any PyTorch model across devices, with no change to the model or loop.

    pipe = fxpipe.pipeline(model, example_input, ["cuda:0", "cuda:1"], chunks=8)
    loss = criterion(pipe(x), y); loss.backward(); opt.step()

How a model becomes a pipeline, one direction of flow, a folder per step:

1. trace (``fxpipe/trace/``): torch.fx captures the model (torch.export when fx cannot) as
   a flat graph whose placeholders are the input values and whose output is a flat tuple;
   every dimension of the inputs may change from call to call unless the model fixes it.
2. price (``fxpipe.passes.price``, the folder ``passes/price/``): every node gets a cost (an
   analytic roofline by default; profiled time, FLOPs or parameter bytes on request) and
   the bytes of its output.
3. partition (``fxpipe.passes.partition``): the graph becomes a networkx cost graph, is
   coarsened into groups no border may split, and is cut into K convex stages with the
   smallest bottleneck under the devices' speeds and memory, then the fewest boundary bytes
   within a slack.
4. split (``fxpipe.passes.split``): a frozen ``PipelinePlan`` and one GraphModule per stage
   whose inputs and outputs are exactly the boundary values (another trace of the model,
   in eval mode or with ``labels=``, is split along the same borders). Beside it,
   ``fxpipe.passes.batch`` turns a loss inside the model into partial sums per micro-batch,
   and ``fxpipe.passes.configure`` (``chunks="auto"``, ``checkpoint="auto"``) runs steps
   2 to 4 per micro-batch count and checkpoint mode and keeps the plan whose predicted step
   (the schedule replayed on the stage costs) is fastest under the memory budgets.
5. run (``fxpipe/runtime/``): micro-batches flow through the stages on a clock-cycle
   schedule, one worker thread per device, copy streams for boundary values, fork/join so
   backward runs in reverse micro-batch order, and checkpoint/recompute with the RNG state
   restored, one variant of the stages per training mode and call structure, each stage
   through ``torch.compile`` on request; ``fxpipe/distributed/`` runs the same plan one
   process per stage, and ``fxpipe/generation/`` runs ``pipe.generate()``: one step of
   generation traced with its key/value cache and split on the same borders, each stage
   keeping its layers' cache, lanes of sequences in a ring of stage workers (or of
   processes, one per stage).
6. view (``fxpipe/views/``): ``print(plan)``, ``plan.draw()``, ``fxpipe.record(pipe)``, the
   planning log and the ``fxpipe inspect`` command.

The front door sits at the top: ``api`` (``fxpipe.plan``, ``fxpipe.pipeline``: where the steps
are joined), ``pipeline`` (``fxpipe.Pipeline``, the ``nn.Module`` with the model's outputs,
gradients, parameters and ``state_dict`` keys), ``ir`` (the frozen records between the
steps), ``options`` (every option checked once), ``errors`` and ``model_state`` (what puts a
model back after fxpipe runs it for its own purposes). Support beside the steps:
``devices/`` (device names, memory budgets, speeds), ``weights/`` (models built on ``meta``,
checkpoints streamed in) and ``interop/`` (what Trainer, Accelerate and Lightning read).
"""

from fxpipe.api import pipeline, plan
from fxpipe.errors import FxPipeError
from fxpipe.ir import PipelinePlan
from fxpipe.pipeline import Pipeline
from fxpipe.views.timeline import Timeline, record
from fxpipe.weights.loading import load_checkpoint

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
