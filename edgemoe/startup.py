"""Start-up progress: each long start-up step (compiling the native kernels, loading weights, pinning,
measuring bandwidths) says what it does before it starts, with an estimate where one is known, and
how long it took when it ends.

Lines go to the ``edgemoe.startup`` logger at INFO; ``edgemoe`` commands print them on stderr
(:func:`edgemoe.cli.main` configures the ``edgemoe`` logger), library users see them when they
configure logging.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("edgemoe.startup")


@contextmanager
def startup_step(what: str, estimate: str | None = None) -> Iterator[None]:
    """Log ``what ...`` (with ``estimate``, e.g. ``"about 12 s"``) now and ``what: done in X s`` after
    the block; a block that raises logs nothing more (the error says what happened)."""
    log.info("%s%s ...", what, f" ({estimate})" if estimate else "")
    t0 = time.perf_counter()
    yield
    log.info("%s: done in %.1f s", what, time.perf_counter() - t0)


def size(nbytes: int) -> str:
    """``nbytes`` for a person: ``"1.6 MB"``, ``"61.1 GB"`` (1e6 / 1e9 bytes)."""
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
