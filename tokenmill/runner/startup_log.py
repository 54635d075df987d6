"""The start-up's running commentary: one log line before each long phase says what it is doing, one
after says how long it took, so a user never waits on a silent process.

`phase("reading the weights of X")` logs "start-up: reading the weights of X ..." when entered and
"start-up: reading the weights of X: 3.2 s" when left (an exception skips the second line; the error
says what happened).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("tokenmill")


@contextmanager
def phase(what: str) -> Iterator[None]:
    """Log `what` before the block runs and its elapsed seconds after."""
    logger.info("start-up: %s ...", what)
    start = time.perf_counter()
    yield
    logger.info("start-up: %s: %.1f s", what, time.perf_counter() - start)
