"""The search's candidates priced in forked worker processes (docs/design.md, "Pricing the
search": "Candidates on every core").

Planning is pure Python and holds the GIL, so one process prices one candidate at a
time. :func:`map_forked` runs ``fn(i)`` for every task index in processes *forked* from
this one: they inherit the captured graph and every cache the parent has filled (the
parent runs the first task itself before forking, so the row facts the first plan reads
are already there); only task indices go out and results come back (pickled). The
results are ``[fn(i) for i in range(n)]``, in that order, whatever the workers do:

- a task that raises in a worker, or whose result does not pickle, is run again in the
  parent (the same exception, raised where the serial loop raises it);
- a worker that dies has its task run in the parent, the others go on;
- a worker that sends nothing for :data:`STALL_S` seconds (or ``STALL_FACTOR`` times the
  slowest task seen, if longer) is killed and the remaining tasks run in the parent.

:func:`search_workers` says how many processes to use: ``AUTOSHARD_SEARCH_WORKERS`` when
set (``1``: serial), else one per CPU this process may run on, up to
:data:`MAX_WORKERS` and one per :data:`MIN_TASKS` tasks (below that, forking costs more
than it saves); always 1 where :func:`fork_blocker` names a reason not to fork.

Example:
    >>> map_forked(lambda i: i * i, 5, workers=1)
    [0, 1, 4, 9, 16]
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings

from ..ir.errors import ConfigError

__all__ = ["ENV", "MAX_WORKERS", "MIN_TASKS", "STALL_S", "STALL_FACTOR", "search_workers", "fork_blocker",
           "map_forked"]

#: the environment variable that sets the number of worker processes (1: serial)
ENV = "AUTOSHARD_SEARCH_WORKERS"
#: at most this many workers by default (each is a copy-on-write fork of the planning process)
MAX_WORKERS = 8
#: at least this many tasks per worker by default: forking a worker (~20 ms for a 7B capture's
#: 400 MB process) and warming its caches cost about as much as pricing two candidates
#: (~40 ms each for llama:7b; docs/design.md, "Pricing the search")
MIN_TASKS = 4
#: seconds a worker may send nothing before its tasks are taken back (at least)
STALL_S = 10.0
#: ... or this many times the slowest task seen so far, if that is longer
STALL_FACTOR = 20


#: the warnings workers sent from a file that is no module's (shown once per text and place)
_SHOWN: dict = {}


def fork_blocker() -> str | None:
    """Why this process must not fork workers now, or None when it may.

    Forking copies the memory of one thread only: a lock another thread holds stays held
    in the child, a process group's sockets and threads are shared or gone, CUDA cannot
    be used again, and in a launched job every rank would fork onto the same cores.

    >>> fork_blocker() is None or isinstance(fork_blocker(), str)
    True
    """
    import multiprocessing
    import threading

    if "fork" not in multiprocessing.get_all_start_methods():
        return "this platform has no fork start method"
    if multiprocessing.current_process().daemon:
        return "a daemonic process may not start processes"
    if threading.active_count() > 1:
        return f"{threading.active_count() - 1} other thread(s) running (a lock one holds stays held in a fork)"
    if any(int(os.environ.get(v, "1") or 1) > 1 for v in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")):
        return "inside a launched job (WORLD_SIZE > 1): every rank would fork onto the same cores"
    torch = sys.modules.get("torch")
    if torch is not None:
        if torch.cuda.is_initialized():
            return "CUDA is initialised (a forked process cannot use it)"
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return "inside a torch.distributed job (the process group's sockets and threads do not fork)"
    return None


def search_workers(tasks: int) -> int:
    """How many processes price ``tasks`` candidates (1: this one, serially).

    Raises:
        ConfigError: ``AUTOSHARD_SEARCH_WORKERS`` is set to something other than a positive integer.

    >>> search_workers(1)
    1
    """
    raw = os.environ.get(ENV, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"{ENV}={raw!r}: expected a positive integer (1: price the candidates serially, "
                              f"N > 1: in N forked processes), or unset for one per CPU")
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = min(cpus, MAX_WORKERS, tasks // MIN_TASKS)
    n = min(n, tasks - 1)           # the parent runs the first task itself
    return n if n > 1 and fork_blocker() is None else 1


def map_forked(fn, n: int, workers: int) -> list:
    """``[fn(i) for i in range(n)]``, the tasks after the first run in ``workers`` forked
    processes (``workers <= 1``: here, one after another). ``fn`` need not pickle (the
    children inherit it); its results must (one that does not is computed here).

    >>> map_forked(str, 3, workers=1)
    ['0', '1', '2']
    """
    if workers <= 1 or n <= 2:
        return [fn(i) for i in range(n)]
    t = time.perf_counter()
    first = fn(0)
    pool = _Pool(fn, workers, slowest=time.perf_counter() - t)
    try:
        got = pool.run(range(1, n))
    finally:
        pool.close()
    out = [first] + [None] * (n - 1)
    for i in range(1, n):
        out[i] = got[i] if i in got else fn(i)      # the tasks the workers gave back, in order
    return out


class _Pool:
    """``workers`` forked children serving task indices over pipes, one task each at a time."""

    def __init__(self, fn, workers: int, *, slowest: float) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self.slowest, self.procs, self.conns, self.stalled = slowest, [], [], False
        for stream in (sys.stdout, sys.stderr):     # or a child's copy of the buffer prints again
            with contextlib.suppress(Exception):
                stream.flush()
        for _ in range(workers):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(there, fn), daemon=True)
            try:
                p.start()
            except OSError:                     # no memory or no process slot left: fewer workers
                here.close()
                break
            finally:
                there.close()
            self.procs.append(p)
            self.conns.append(here)

    def run(self, tasks) -> dict:
        """``{i: fn(i)}`` for the tasks the workers finished; the others are the caller's."""
        from multiprocessing.connection import wait

        todo, got, busy = list(tasks)[::-1], {}, {}      # busy: worker -> (task, sent at)
        while todo or busy:
            for w in self._idle(busy):
                if not todo:
                    break
                try:
                    self.conns[w].send(todo[-1])
                except OSError:                 # died while idle
                    self._drop(w)
                    continue
                busy[w] = (todo.pop(), time.perf_counter())
            if not busy:                        # every worker gone: the rest is the caller's
                break
            ready = wait([self.conns[w] for w in busy], timeout=max(STALL_S, STALL_FACTOR * self.slowest))
            if not ready:                       # stalled: everything left is the caller's
                self.stalled = True
                break
            for w in [w for w in busy if self.conns[w] in ready]:
                i, sent = busy.pop(w)
                try:
                    ok, value, said = self.conns[w].recv()
                except Exception:               # noqa: BLE001 - died (EOF) or sent garbage: the caller's
                    self._drop(w)
                    continue
                for message, category, filename, lineno in said:
                    warnings.warn_explicit(message, category, filename, lineno, registry=_registry(filename))
                if ok:
                    got[i] = value
                    self.slowest = max(self.slowest, time.perf_counter() - sent)
        return got

    def _idle(self, busy: dict) -> list[int]:
        return [w for w, p in enumerate(self.procs) if p is not None and w not in busy]

    def _drop(self, w: int) -> None:
        p, self.procs[w] = self.procs[w], None
        p.kill()
        p.join()
        self.conns[w].close()

    def close(self) -> None:
        """Every worker told to stop (killed and reaped, where they stalled). A worker that
        was told is not waited for (its exit, unmapping a copy of this process, takes longer
        than its fork): multiprocessing reaps it when it next starts a process, or at exit."""
        for w, p in enumerate(self.procs):
            if p is None:
                continue
            with contextlib.suppress(OSError):
                self.conns[w].send(None)
            if self.stalled:
                p.kill()
                p.join()
            self.conns[w].close()


def _serve(conn, fn) -> None:
    """A worker: ``fn(i)`` for each index received until None; sends ``(ok, result, warnings)``,
    ``ok`` False where ``fn`` raised or its result does not pickle (the parent runs it again)."""
    import pickle
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C: the parent stops and kills its workers
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)        # the parent's intra-op threads did not fork; use none
    # the filters (and the registries of what was shown) are the parent's as they were at the
    # fork: what a worker records is what the serial loop would have shown until then
    with warnings.catch_warnings(record=True) as caught:
        while (i := _next(conn)) is not None:
            try:
                sends = [(True, fn(i), [(m.message, m.category, m.filename, m.lineno) for m in caught])]
                sends.append(sends[0][:2] + ([],))
            except Exception:           # noqa: BLE001 - re-raised by the parent's own run of fn(i)
                sends = []
            caught.clear()
            for msg in sends + [(False, None, [])]:
                try:
                    conn.send_bytes(pickle.dumps(msg))
                    break
                except Exception:       # noqa: BLE001 - does not pickle: less, or the parent runs it
                    continue


def _next(conn):
    """The next task index, or None: stop (the parent said so, or is gone)."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _registry(filename: str) -> dict:
    """The registry of warnings shown from the module ``filename`` (where :func:`warnings.warn`
    keeps it), so a warning a worker sends shows no more often than the serial loop's."""
    for m in list(sys.modules.values()):
        if getattr(m, "__file__", None) == filename:
            return m.__dict__.setdefault("__warningregistry__", {})
    return _SHOWN
