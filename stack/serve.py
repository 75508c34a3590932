"""Keeping a started stack serving until Ctrl-C (or SIGTERM), and stopping if a service dies:
``greyhound up``, and ``greyhound sim run --serve`` after its run."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from stack.up import Stack


@contextlib.contextmanager
def stop_signals() -> Iterator[Callable[[], bool]]:
    """SIGINT and SIGTERM ask the block to stop (it polls the callable) instead of killing the
    process before it stopped its services, which run in sessions of their own."""
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    previous = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def serve_until_stopped(stack: Stack, data_dir: Path, stopped: Callable[[], bool]) -> int:
    """0 once asked to stop, 1 when a service exited on its own (its log says why)."""
    while not stopped():
        dead = stack.dead()
        if dead:
            print(f"service(s) {', '.join(dead)} exited; stopping (see {data_dir}/logs)",
                  file=sys.stderr)
            for name in dead:
                print(f"{name}: {stack.last_error(name) or '(nothing logged)'}", file=sys.stderr)
            return 1
        time.sleep(0.5)
    return 0
