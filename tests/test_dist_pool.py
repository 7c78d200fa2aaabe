"""Tests for the multi-rank worker pool in tests/dist_pool.py."""

import time

import pytest

from dist_pool import RankPool, get_pool, worker_cache


# Task functions must be module-level so they pickle by reference.

def all_reduce(rank, world_size, base):
    import torch
    import torch.distributed as dist

    t = torch.full((3,), float(rank + base))
    dist.all_reduce(t)
    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    return t.tolist()


def _raise_on_rank(rank, world_size, bad_rank):
    if rank == bad_rank:
        raise ValueError(f"boom from rank {rank}")
    return rank


def _sleep(rank, world_size, seconds):
    time.sleep(seconds)
    return rank


def _count_calls(rank, world_size):
    cache = worker_cache()
    cache["calls"] = cache.get("calls", 0) + 1
    return cache["calls"]


def _rank_and_kwargs(rank, world_size, *, tag):
    return (rank, world_size, tag)


def test_all_reduce_two_ranks():
    pool = get_pool(2)
    out = pool.run(all_reduce, 10)
    expected = [float(10 + 11)] * 3  # (0 + 10) + (1 + 10)
    assert out == [expected, expected]
    assert get_pool(2) is pool  # cached and still healthy


def test_kwargs_and_rank_order():
    assert get_pool(2).run(_rank_and_kwargs, tag="x") == [(0, 2, "x"), (1, 2, "x")]


def test_raising_rank_reports_traceback_and_pool_recovers():
    pool = get_pool(2)
    with pytest.raises(RuntimeError) as ei:
        pool.run(_raise_on_rank, 1)
    msg = str(ei.value)
    assert "rank 1 traceback" in msg
    assert "ValueError: boom from rank 1" in msg
    assert "_raise_on_rank" in msg
    assert pool.broken

    fresh = get_pool(2)
    assert fresh is not pool
    assert fresh.run(all_reduce, 0) == [[1.0] * 3, [1.0] * 3]


def test_timeout_raises_within_bounded_time():
    pool = RankPool(2, timeout=5)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            pool.run(_sleep, 60)
        assert time.monotonic() - t0 < 15
        assert pool.broken and not pool.healthy
        with pytest.raises(RuntimeError):
            pool.run(_sleep, 0)
    finally:
        pool.close()


def test_unpicklable_fn_fails_fast_and_keeps_pool():
    pool = get_pool(2)
    with pytest.raises(TypeError):
        pool.run(lambda rank, ws: rank)
    assert pool.healthy and get_pool(2) is pool


def test_four_ranks():
    out = get_pool(4).run(all_reduce, 1)
    expected = [float(sum(r + 1 for r in range(4)))] * 3
    assert out == [expected] * 4


def test_worker_cache_persists_across_runs():
    pool = get_pool(2)
    first = pool.run(_count_calls)
    second = pool.run(_count_calls)
    assert [b - a for a, b in zip(first, second)] == [1, 1]
