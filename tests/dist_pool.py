"""A reusable pool of gloo worker processes for multi-rank CPU tests.

Usage::

    from dist_pool import get_pool, worker_cache

    def _allreduce(rank, world_size, x):        # module-level => picklable
        import torch, torch.distributed as dist
        t = torch.tensor([float(rank + x)])
        dist.all_reduce(t)
        return t.item()

    def test_it():
        assert get_pool(2).run(_allreduce, 1) == [3.0, 3.0]

Each worker is a ``spawn``-ed process that has joined a gloo process group of
``world_size`` ranks on 127.0.0.1 and then loops on its own task queue. A task
is ``fn(rank, world_size, *args, **kwargs)``; ``run`` returns the per-rank
results ordered by rank.  ``fn`` and its arguments are pickled *by value in the
parent* (plain ``pickle``, so tensors are copied, no shared-memory fds), hence
``fn`` must be a module-level function of an importable module (a test module
is fine: the parent's current ``sys.path`` travels with every task).

Failure policy: if any rank raises, dies, or the task overruns ``timeout``,
the pool is torn down (ranks may be stuck in a collective that will never
complete) and marked broken; ``get_pool`` transparently builds a fresh one on
its next call.  ``run`` never hangs: it raises ``RuntimeError`` (with every
failing rank's traceback) or ``TimeoutError``.

``worker_cache()`` returns a dict that lives as long as the worker process, to
keep expensive objects (model exports, ...) across tasks of the same pool.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

import multiprocessing as mp

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TESTS_DIR)

# How long to wait for the other ranks' reports once one rank has failed
# (they are typically stuck in a collective waiting for the failed rank).
_FAILURE_GRACE_S = 1.0
# Poll interval for the result queue / liveness checks in the parent.
_POLL_S = 0.2


# --------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------

def worker_cache() -> dict:
    """A dict that persists within the current (worker) process across tasks.

    Stored on the ``sys`` module rather than in this module's globals so that it
    is the same dict even if this file gets imported under two names (e.g.
    ``dist_pool`` and ``tests.dist_pool``).  In the parent process it simply
    returns a process-wide dict as well.
    """
    cache = getattr(sys, "_autoshard_worker_cache", None)
    if cache is None:
        cache = {}
        sys._autoshard_worker_cache = cache  # type: ignore[attr-defined]
    return cache


def in_worker() -> bool:
    """True inside a RankPool worker process."""
    return os.environ.get("AUTOSHARD_RANKPOOL_WORKER") == "1"


def _extend_sys_path(paths) -> None:
    for p in paths:
        if p and p not in sys.path:
            sys.path.append(p)


def _worker_main(rank: int, world_size: int, init_method: str, task_q, result_q,
                 pg_timeout_s: float, sys_path: list, parent_pid: int) -> None:
    os.environ["AUTOSHARD_RANKPOOL_WORKER"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Make gloo use loopback: resolving the hostname can give an address that
    # is not reachable inside sandboxes, which makes gloo hang at connect.
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    _extend_sys_path([_REPO_ROOT, _TESTS_DIR, *sys_path])

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
    except BaseException:
        result_q.put((rank, 0, False, traceback.format_exc()))
        return
    result_q.put((rank, 0, True, None))  # task id 0 == "ready"

    while True:
        try:
            item = task_q.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:  # parent is gone: don't linger
                break
            continue
        if item is None:  # orderly shutdown
            break
        task_id, paths, payload = item
        try:
            _extend_sys_path(paths)
            fn, args, kwargs = pickle.loads(payload)
            out = fn(rank, world_size, *args, **kwargs)
            msg = (rank, task_id, True, pickle.dumps(out))
        except BaseException:  # report everything, incl. SystemExit / asserts
            msg = (rank, task_id, False, traceback.format_exc())
        result_q.put(msg)

    try:
        dist.destroy_process_group()
    except BaseException:
        pass


# --------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankPool:
    """``world_size`` spawned processes joined in one gloo process group."""

    def __init__(self, world_size: int, *, timeout: float = 120.0,
                 pg_timeout: float = 300.0, start_timeout: float | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = float(timeout)
        self.pg_timeout = float(pg_timeout)
        self.broken = False
        self.closed = False
        self._task_ids = itertools.count(1)
        self._procs: list = []
        self._task_qs: list = []
        self._result_q = None
        # Starting means importing torch in every process: can be slow on a
        # loaded 2-core box, so don't tie it to a small per-task timeout.
        start_timeout = max(self.timeout, 120.0) if start_timeout is None else start_timeout
        last_err: BaseException | None = None
        for _attempt in range(2):  # a retry covers the (rare) free-port race
            try:
                self._start(start_timeout)
                return
            except RuntimeError as e:
                last_err = e
                self._teardown(graceful=False)
        self.broken = True
        self.closed = True
        raise RuntimeError(f"could not start a RankPool of {world_size} ranks") from last_err

    # -- lifecycle ---------------------------------------------------------

    def _start(self, start_timeout: float) -> None:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._result_q = ctx.Queue()
        self._task_qs = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = []
        for rank in range(self.world_size):
            p = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, init_method, self._task_qs[rank],
                      self._result_q, self.pg_timeout, list(sys.path), os.getpid()),
                name=f"rankpool-{self.world_size}-r{rank}",
                daemon=True,
            )
            p.start()
            self._procs.append(p)
        self.broken = False
        self.closed = False
        ok, fails, missing = self._collect(0, start_timeout)
        if fails or missing:
            detail = "".join(f"\n--- rank {r} failed to start:\n{tb}" for r, tb in sorted(fails.items()))
            if missing:
                detail += f"\nranks {sorted(missing)} did not start within {start_timeout:.0f}s"
            raise RuntimeError("RankPool start failed:" + detail)

    def _teardown(self, graceful: bool) -> None:
        if graceful and not self.broken:
            for q in self._task_qs:
                try:
                    q.put(None)
                except Exception:
                    pass
            deadline = time.monotonic() + 10.0
            for p in self._procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for q in [*self._task_qs, self._result_q]:
            if q is None:
                continue
            try:
                q.cancel_join_thread()  # never block on unread data at exit
                q.close()
            except Exception:
                pass
        self._procs, self._task_qs, self._result_q = [], [], None

    def close(self) -> None:
        """Shut the workers down (gracefully if healthy, else terminate)."""
        if self.closed:
            return
        try:
            self._teardown(graceful=True)
        finally:
            self.closed = True

    def _fail(self) -> None:
        """Declare the pool broken and kill it: ranks may be desynchronised."""
        self.broken = True
        try:
            self._teardown(graceful=False)
        finally:
            self.closed = True

    @property
    def healthy(self) -> bool:
        return not (self.broken or self.closed) and all(p.is_alive() for p in self._procs)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort; atexit / conftest do the real cleanup
        try:
            if not self.closed:
                self._teardown(graceful=False)
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "broken" if self.broken else "closed" if self.closed else "live"
        return f"<RankPool world_size={self.world_size} {state}>"

    # -- running tasks -----------------------------------------------------

    def _collect(self, task_id: int, timeout: float):
        """Gather (ok results, failure tracebacks, missing ranks) for task_id."""
        ok: dict[int, Any] = {}
        fails: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        grace_deadline = None
        while len(ok) + len(fails) < self.world_size:
            now = time.monotonic()
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            try:
                rank, tid, good, data = self._result_q.get(timeout=min(_POLL_S, limit - now))
            except queue.Empty:
                for r, p in enumerate(self._procs):
                    if not p.is_alive() and r not in ok and r not in fails:
                        fails[r] = f"worker process died (exitcode {p.exitcode})"
                        if grace_deadline is None:
                            grace_deadline = time.monotonic() + _FAILURE_GRACE_S
                continue
            if tid != task_id:  # stale answer of an earlier task
                continue
            if good:
                ok[rank] = data
            else:
                fails[rank] = data
                if grace_deadline is None:
                    grace_deadline = time.monotonic() + _FAILURE_GRACE_S
        missing = set(range(self.world_size)) - set(ok) - set(fails)
        return ok, fails, missing

    def run(self, fn: Callable, *args, **kwargs) -> list:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank.

        Returns the per-rank return values ordered by rank.  Raises
        RuntimeError if any rank raised or died (with their tracebacks), and
        TimeoutError if not all ranks answered within ``self.timeout`` s.
        Either way the pool is then broken (``get_pool`` replaces it).
        """
        if self.broken or self.closed:
            raise RuntimeError(f"{self!r} is not usable; use get_pool() for a fresh one")
        try:  # fail early, in the parent, without touching the workers
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(
                f"RankPool.run: cannot pickle {getattr(fn, '__qualname__', fn)!r} or its "
                f"arguments ({e}); use a module-level function and picklable args"
            ) from e
        task_id = next(self._task_ids)
        paths = list(sys.path)
        for q in self._task_qs:
            q.put((task_id, paths, payload))

        ok, fails, missing = self._collect(task_id, self.timeout)
        if not fails and not missing:
            results = []
            for r in range(self.world_size):
                try:
                    results.append(pickle.loads(ok[r]))
                except Exception as e:
                    self._fail()
                    raise RuntimeError(f"could not unpickle the result of rank {r}: {e}") from e
            return results

        name = getattr(fn, "__qualname__", repr(fn))
        self._fail()
        if fails:
            parts = [f"{name} failed on rank(s) {sorted(fails)} of {self.world_size}"]
            for r in sorted(fails):
                parts.append(f"--- rank {r} traceback:\n{fails[r].rstrip()}")
            if missing:
                parts.append(f"(ranks {sorted(missing)} gave no answer; pool torn down)")
            raise RuntimeError("\n".join(parts))
        raise TimeoutError(
            f"{name} on {self.world_size} ranks: no answer from rank(s) {sorted(missing)} "
            f"within {self.timeout:g}s; pool terminated"
        )


# --------------------------------------------------------------------------
# module-level cache: one live pool per world size
# --------------------------------------------------------------------------

_POOLS: dict[int, RankPool] = {}


def get_pool(world_size: int, **kwargs) -> RankPool:
    """The cached pool for ``world_size``; a broken/dead one is replaced.

    ``pg_timeout`` only applies when a new pool is built; ``timeout`` (the per-task limit)
    also applies to a live pool, from this call on, so a test that asks for a long limit
    gets it whichever test built the pool.
    """
    pool = _POOLS.get(world_size)
    if pool is not None and not pool.healthy:
        pool.close()
        pool = None
    if pool is None:
        pool = RankPool(world_size, **kwargs)
        _POOLS[world_size] = pool
    elif "timeout" in kwargs:
        pool.timeout = float(kwargs["timeout"])
    return pool


def close_all_pools(*, graceful: bool = True) -> None:
    """Close every cached pool. ``graceful=False`` terminates the workers at once: a
    graceful close waits up to 10 s per pool, and ranks that created subgroups
    (every 2d / 2.5d / 3d mesh) do not finish ``destroy_process_group`` in that time."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        try:
            if graceful:
                pool.close()
            else:
                pool._fail()
        except Exception:
            pass


atexit.register(close_all_pools)
