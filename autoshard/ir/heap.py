"""The process's heap during planning: Python's cyclic garbage collector paused.

Capture, planning and rewriting allocate hundreds of thousands of small objects (fx
nodes, fake tensors, sympy expressions) on top of the millions torch and transformers
keep alive, and each full collection walks that whole heap again: 40 % of a second
``shard()`` in one process, ~2 of the ~10 s of user CPU of a cold ``autoshard plan
llama:7b -w 64``, 0.6 of the 2.4 s of the 7B search's walks (docs/design.md, "Pricing
the search"). The cycles they leave are few (15 k objects after the 7B search) and go at
the collector's next run after the pause.
"""

from __future__ import annotations

import contextlib
import gc

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused():
    """Within: the cyclic garbage collector does not run (restored on exit, as it was; a
    pause inside a pause leaves it to the outer one). Also a decorator:
    ``@collector_paused()``.

    >>> with collector_paused():
    ...     gc.isenabled()
    False
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
