"""The compiler: a model and its example to a plan and stage programs (``steps``), a run's
options resolved into the configuration the runtime runs with (``resolve``), and the model
traced again when a running pipeline meets another mode or call structure (``retrace``).
The front door (:mod:`fxpipe.api`) and :mod:`fxpipe.distributed` call it; the runtime holds
only the :class:`~fxpipe.compiler.retrace.Retracer` it is handed."""

from fxpipe.compiler.resolve import resolve_run
from fxpipe.compiler.retrace import Retracer
from fxpipe.compiler.steps import (
    Compiled,
    check_meta_stages,
    compile_model,
    traced_example,
    traced_once,
)

__all__ = [
    "Compiled",
    "compile_model",
    "traced_example",
    "traced_once",
    "check_meta_stages",
    "resolve_run",
    "Retracer",
]
