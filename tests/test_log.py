"""autoshard.ir.log.warn: a warning once per job, on rank 0; other ranks log it at debug."""

from __future__ import annotations

import logging
import warnings

from dist_pool import get_pool

from autoshard.ir.errors import AutoshardWarning
from autoshard.ir.log import warn


def _warn_on_rank(rank, world_size):
    import logging
    import warnings

    from autoshard.ir.log import warn

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("autoshard")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            warn("vocab does not divide", AutoshardWarning)
    finally:
        log.removeHandler(handler)
    return [str(x.message) for x in w], [r.getMessage() for r in records]


def test_warn_without_process_group(caplog):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        warn("once", AutoshardWarning)
    assert [(x.category, str(x.message)) for x in w] == [(AutoshardWarning, "once")]


def test_warn_only_on_rank_0():
    r0, r1 = get_pool(2).run(_warn_on_rank)
    assert r0 == (["vocab does not divide"], [])
    assert r1 == ([], ["AutoshardWarning: vocab does not divide"])
