"""Thread snapshots for leak checks that tolerate threads of earlier tests still exiting."""

from __future__ import annotations

import threading


def live_threads() -> set[threading.Thread]:
    """The threads running now (a thread that has stopped but is still listed is left out)."""
    return {t for t in threading.enumerate() if t.is_alive()}
