"""Views: what people read about a plan and a run. Text (``report``), pictures (``viz``),
one HTML page (``html_report``), the recorded run (``timeline``: ``fxpipe.record``), and the
``fxpipe`` command line (``cli``, with ``factory`` turning its strings into a model).

Views read plans and timelines; nothing in the compiler or the runtime imports them.
"""
