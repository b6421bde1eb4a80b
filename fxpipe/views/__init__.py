"""Views: what people read about a plan and a run. Text (``report``), pictures (``viz``),
one HTML page (``html_report``), the recorded run (``timeline``: ``fxpipe.record``), and the
``fxpipe`` command line (``cli``, with ``factory`` turning its strings into a model).

Views read plans and timelines; nothing in the compiler or the runtime imports them. A
plan's own ``summary()``, ``to_dot()``, ``draw()`` and ``configurations()`` are this
package's, handed to :mod:`fxpipe.ir` here when the package is imported.
"""

from fxpipe.ir import show_plans_with
from fxpipe.views.configurations import configuration_table, plan_configurations
from fxpipe.views.report import plan_summary, plan_to_dot
from fxpipe.views.viz import draw_plan

show_plans_with(
    summary=plan_summary,
    to_dot=plan_to_dot,
    draw=draw_plan,
    configurations=plan_configurations,
    table=configuration_table,
)
