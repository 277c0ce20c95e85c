"""pytest plugin of the GPU calls: `-p deadline_plugin --deadline S` ends the run when one test runs
longer than S seconds.

A hung GPU kernel blocks its thread inside the driver, where no Python signal handler runs; the
watchdog is faulthandler's C thread, which prints every thread's traceback after "Timeout
(H:MM:SS)!" and exits the process (status 1). `pytest -v` has printed the test's id before it
started, so the log names it. The traceback goes to the stderr this process started with (copied
here, at import, before pytest's capture replaces file descriptor 2).
"""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Iterator

import pytest

_STDERR = os.fdopen(os.dup(2), "w")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--deadline", type=float, default=0.0, help="seconds one test may run before the run ends")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    seconds = item.config.getoption("deadline")
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=True, file=_STDERR)
    try:
        yield
    finally:
        if seconds > 0:
            faulthandler.cancel_dump_traceback_later()
