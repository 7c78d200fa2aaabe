"""What autoshard tells the user while it runs: warnings once per job (rank 0),
and progress bars for long loads and saves.

Every rank runs the same validation, so a warning raised per rank would print
once per process (4× on 4 ranks). :func:`warn` prints it on rank 0 only, or in a
single process; the other ranks log it at debug level.

    >>> import warnings
    >>> from autoshard.ir.errors import AutoshardWarning
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     warn("vocab 50257 does not divide", AutoshardWarning)
    >>> [str(x.message) for x in w]
    ['vocab 50257 does not divide']
"""

from __future__ import annotations

import logging
import sys
import warnings

__all__ = ["warn", "rank", "progress", "show_progress", "quiet_on_other_ranks"]

logger = logging.getLogger("autoshard")


def rank() -> int:
    """This process's global rank, 0 without an initialised process group.

    Does not import torch.distributed when nothing else did (no group can exist then)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank()


def quiet_on_other_ranks(fn):
    """Decorate a face (``shard``, ``from_pretrained``): while it runs on a rank other than
    0, warnings and transformers' log lines (its load reports) are dropped, so a job
    prints each once, from rank 0, not once per rank. The rank is the process group's,
    or torchrun's ``RANK`` before the group exists."""
    import functools
    import os

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if rank() == 0 and os.environ.get("RANK", "0") in ("", "0"):
            return fn(*args, **kwargs)
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return fn(*args, **kwargs)
        finally:
            hf_logging.set_verbosity(level)
    return wrapper


def warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 2) -> None:
    """``warnings.warn`` on rank 0 (or without a process group); a debug log line elsewhere."""
    if rank() == 0:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    else:
        logger.debug("%s: %s", category.__name__, message)


def progress(items, description: str, enabled: bool, total: int | None = None):
    """Yield ``items``, with a rich progress bar on stderr when ``enabled``."""
    if not enabled:
        yield from items
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True)) as prog:
        task = prog.add_task(description, total=len(items) if total is None else total)
        for x in items:
            yield x
            prog.advance(task)


def show_progress(enabled: bool | None, rank: int, n: int) -> bool:
    """Explicit ``enabled`` wins; by default a bar on rank 0 for more than 8 tensors."""
    return bool(enabled) if enabled is not None else (rank == 0 and n > 8)
