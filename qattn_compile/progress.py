"""Progress lines for CLI steps that take more than a couple of seconds."""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager


@contextmanager
def step(message: str, stream=None):
    """Show ``message`` with a live elapsed-time counter (on a terminal) and the final time."""
    stream = stream or sys.stderr
    start = time.perf_counter()
    done = threading.Event()
    live = stream.isatty()

    def tick():
        while not done.wait(1.0):
            stream.write(f"\r{message} ... {time.perf_counter() - start:5.0f} s")
            stream.flush()

    stream.write(f"{message} ..." + ("" if live else "\n"))
    stream.flush()
    ticker = threading.Thread(target=tick, daemon=True) if live else None
    if ticker:
        ticker.start()
    outcome = "failed after"
    try:
        yield
        outcome = "done in"
    finally:
        done.set()
        if ticker:
            ticker.join()
        prefix = "\r" + message + " ..." if live else "  "
        stream.write(f"{prefix} {outcome} {time.perf_counter() - start:.1f} s\n")
        stream.flush()
