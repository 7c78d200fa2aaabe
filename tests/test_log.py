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


def test_faces_are_quiet_on_other_ranks(monkeypatch):
    """A decorated face prints warnings and transformers' log lines once per job: on
    rank 0, not on the others (torchrun's RANK counts before a process group exists)."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    from autoshard.ir.log import quiet_on_other_ranks

    @quiet_on_other_ranks
    def load():
        warnings.warn("a load report", UserWarning)
        hf_logging.get_logger("transformers.modeling_utils").warning("config report")
        return 7

    # records are caught by a handler of our own: transformers' stream handler holds
    # whichever sys.stderr existed when it was made, which capsys cannot see
    lines: list[str] = []
    catcher = logging.Handler()
    catcher.emit = lambda record: lines.append(record.getMessage())
    hf_log = hf_logging.get_logger("transformers.modeling_utils")
    hf_log.addHandler(catcher)
    seen = {}
    try:
        for r in ("1", "0"):
            monkeypatch.setenv("RANK", r)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                assert load() == 7
            seen[r] = ([str(x.message) for x in w], list(lines))
            lines.clear()
    finally:
        hf_log.removeHandler(catcher)
    assert seen["1"] == ([], [])
    assert seen["0"] == (["a load report"], ["config report"])
    assert hf_logging.get_verbosity() == hf_logging.WARNING       # restored
