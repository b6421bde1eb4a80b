"""Views: what people read about a plan and a run. Text (``report``), pictures (``viz``),
one HTML page (``html_report``), the configurations weighed (``configurations``) and the
recorded run (``timeline``: ``fxpipe.record``).

Views read plans and timelines; nothing in the compiler or the runtime imports them. A
plan's own ``summary()``, ``to_dot()``, ``draw()`` and ``configurations()`` are this
package's functions, named here: a plan asked to show itself imports this package and calls
them (by name, so that the records import no view).
"""

from fxpipe.views.configurations import configuration_table, plan_configurations
from fxpipe.views.report import plan_summary, plan_to_dot
from fxpipe.views.viz import draw_plan

__all__ = [
    "plan_summary",
    "plan_to_dot",
    "draw_plan",
    "plan_configurations",
    "configuration_table",
]
