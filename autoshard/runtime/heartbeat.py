"""Rank liveness: a frozen rank ends the job in about ``AUTOSHARD_HEARTBEAT`` seconds
instead of at the collective timeout.

A rank that dies closes its sockets and the others' next collective fails at
once; a rank that is frozen (stopped, swapped out, stuck in a driver) keeps them
open, and the others wait in their collective for the whole process-group
timeout (``AUTOSHARD_TIMEOUT``, 300 s by default, which large steps may
legitimately need). So every rank runs a background thread that beats through
the rendezvous store (a counter under ``autoshard/heartbeat/<rank>``) every
few seconds, while its main thread computes or waits, and watches the others'
counters. A peer whose counter has not moved for ``AUTOSHARD_HEARTBEAT`` seconds
(default 30; ``0`` turns the heartbeat off) — or a store that stops answering —
makes every live rank print a :class:`~autoshard.ir.errors.CollectiveError` message
naming the frozen rank(s) and the last checkpoint to resume from, and exit with
status 1: the main thread is blocked inside a C++ collective where no Python
exception can reach it, and exiting is what lets torchrun end the job.

Started by :func:`autoshard.shard` (once per process);
:func:`autoshard.training.train.save_state` records each completed checkpoint.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

__all__ = ["start", "stop", "note_checkpoint", "stale_after", "DEFAULT_STALE_S"]

DEFAULT_STALE_S = 30.0
_STATE: dict = {"thread": None, "stop": None, "checkpoint": None}


def stale_after(environ=None) -> float:
    """``AUTOSHARD_HEARTBEAT`` in seconds (default 30); 0 turns the heartbeat off.

    >>> stale_after({"AUTOSHARD_HEARTBEAT": "12"}), stale_after({})
    (12.0, 30.0)
    """
    from ..ir.errors import ConfigError

    raw = (os.environ if environ is None else environ).get("AUTOSHARD_HEARTBEAT", str(DEFAULT_STALE_S))
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if v < 0 or v != v:
        raise ConfigError(f"AUTOSHARD_HEARTBEAT={raw!r} must be a number of seconds >= 0 (0 turns it off; "
                          f"default {DEFAULT_STALE_S:g})")
    return v


def note_checkpoint(path) -> None:
    """Remember the last complete checkpoint, for the message of a frozen job."""
    _STATE["checkpoint"] = str(path)


def start(stale: float | None = None) -> bool:
    """Start this rank's heartbeat (idempotent; a no-op without a process group, on one
    rank, or with ``AUTOSHARD_HEARTBEAT=0``). Returns whether a heartbeat runs."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if _STATE["thread"] is not None:
        return True
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    stale = stale_after() if stale is None else stale
    if stale == 0:
        return False
    rank, world = dist.get_rank(), dist.get_world_size()
    store = c10d._get_default_store()
    halt = threading.Event()
    t = threading.Thread(target=_run, args=(store, rank, world, stale, halt), name="autoshard-heartbeat",
                         daemon=True)
    _STATE.update(thread=t, stop=halt)
    t.start()
    if not _STATE.get("atexit"):
        # stop and join before interpreter teardown: a daemon thread killed inside a
        # C++ store call aborts the process ("terminate called without an active exception")
        atexit.register(stop)
        _STATE["atexit"] = True
    return True


def stop() -> None:
    """Stop this rank's heartbeat (e.g. before a planned long pause on one rank only)
    and wait for its threads to leave the store (also run at exit)."""
    if _STATE["stop"] is not None:
        _STATE["stop"].set()
    t = _STATE["thread"]
    _STATE.update(thread=None, stop=None)
    if t is not None and t is not threading.current_thread():
        t.join(timeout=10)


def _run(store, rank: int, world: int, stale: float, stop: threading.Event) -> None:
    interval = max(0.2, min(2.0, stale / 10))
    peers = [r for r in range(world) if r != rank]
    seen = {r: None for r in peers}
    moved = {r: time.monotonic() for r in peers}        # a peer gets ``stale`` s to show its first beat
    answered = [time.monotonic()]
    beat = 0

    def beats():
        nonlocal beat
        while not stop.is_set():
            beat += 1
            store.set(f"autoshard/heartbeat/{rank}", str(beat))
            for r in peers:
                key = f"autoshard/heartbeat/{r}"
                if store.check([key]):
                    v = store.get(key)
                    if v != seen[r]:
                        seen[r], moved[r] = v, time.monotonic()
            answered[0] = time.monotonic()
            stop.wait(interval)

    worker = threading.Thread(target=_guard(beats), name="autoshard-heartbeat-store", daemon=True)
    worker.start()
    try:
        _watch(rank, world, stale, interval, stop, peers, moved, answered)
    finally:
        stop.set()
        worker.join(timeout=5)


def _watch(rank, world, stale, interval, stop, peers, moved, answered) -> None:
    import torch.distributed as dist

    while not stop.wait(interval):
        if not dist.is_initialized():       # destroy_process_group(): the job is over for this rank
            return
        now = time.monotonic()
        frozen = [r for r in peers if now - moved[r] > stale]
        if frozen:
            _end(rank, f"rank(s) {frozen} of {world} sent no heartbeat for more than {stale:g} s "
                       f"(frozen or stopped: a dead rank would have closed its connections)")
        if now - answered[0] > stale:
            _end(rank, f"the rendezvous store (MASTER_ADDR={os.environ.get('MASTER_ADDR', '?')}:"
                       f"{os.environ.get('MASTER_PORT', '?')}) has not answered for more than {stale:g} s: its host "
                       f"(the launcher or rank 0) is frozen or gone")


def _guard(fn):
    def run():
        try:
            fn()
        except Exception:  # noqa: BLE001 - a store that fails is seen as one that stopped answering
            pass
    return run


def _end(rank: int, why: str) -> None:
    ckpt = _STATE["checkpoint"]
    resume = (f"; the last complete checkpoint is {ckpt}: resume from it" if ckpt else
              "; no checkpoint was saved in this run")
    msg = (f"autoshard: CollectiveError on rank {rank}: {why}; ending this rank instead of waiting for the "
           f"collective timeout (AUTOSHARD_HEARTBEAT sets the limit, 0 turns it off){resume}")
    try:
        print(msg, file=sys.stderr, flush=True)
    finally:
        os._exit(1)
