"""The search's candidates priced in forked workers (autoshard/planning/workers.py): the
same results in the same order as the serial loop, whatever a worker does (raises, dies,
stalls, returns what does not pickle, warns), and serial where forking is unsafe."""

from __future__ import annotations

import os
import threading
import time
import warnings

import pytest
import transformers

from autoshard.io.builder import model_from
from autoshard.ir.errors import ConfigError
from autoshard.launch.capture_share import capture_for_plan
from autoshard.planning import workers
from autoshard.planning.search import search
from autoshard.planning.workers import fork_blocker, map_forked, search_workers

PARENT = os.getpid()


def _in_child() -> bool:
    return os.getpid() != PARENT


@pytest.fixture
def forks(monkeypatch):
    """The pools started (a spy on ``workers._Pool``), and fork allowed even where the test
    session runs threads (the rank pools' queue feeders: nothing a worker touches)."""
    started = []
    real = workers._Pool

    def spy(*a, **k):
        started.append(real(*a, **k))
        return started[-1]

    monkeypatch.setattr(workers, "_Pool", spy)
    monkeypatch.setattr(workers, "fork_blocker", lambda: None)
    return started


def test_serial_and_two_workers_rank_the_same_table(forks, monkeypatch):
    """Tiny Llama (6 layers, stamped: candidates priced on the 3-layer graph), cp searched on 2
    ranks: serial and 2 workers give equal SearchResults, candidate by candidate (the same
    capture as tests/planning/test_search_pricing.py's: one export per session)."""
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    cap = capture_for_plan(model_from(cfg).train())
    kw = dict(world_size=2, cp=None, batch_size=2, seq_len=32)
    monkeypatch.setenv(workers.ENV, "1")
    serial = search(cap, **kw)
    assert not forks
    monkeypatch.setenv(workers.ENV, "2")
    forked = search(cap, **kw)
    assert len(forks) == 1 and len(forks[0].procs) == 2           # the workers did price them
    assert len(serial.results) >= 4 and serial.ranked
    assert forked.results == serial.results
    assert forked.to_dict() == serial.to_dict()
    assert forked.plan.nodes == serial.plan.nodes


def test_results_come_back_in_task_order_from_the_children():
    got = map_forked(lambda i: (i, os.getpid()), 12, workers=2)
    assert [i for i, _ in got] == list(range(12))
    assert got[0][1] == PARENT                                  # the first task warms the parent
    assert {p for _, p in got[1:]} - {PARENT}                   # the rest ran in forked workers


def test_a_task_that_raises_in_a_worker_runs_again_here():
    assert map_forked(lambda i: 1 // 0 if i == 3 and _in_child() else i, 6, workers=2) == list(range(6))


def test_an_error_is_raised_as_the_serial_loop_raises_it():
    def fn(i):
        if i >= 3:
            raise ValueError(f"task {i}")
        return i

    with pytest.raises(ValueError, match="task 3"):
        map_forked(fn, 8, workers=2)


def test_a_worker_that_dies_has_its_task_run_here():
    def fn(i):
        if i == 2 and _in_child():
            os._exit(3)
        return i * 10

    assert map_forked(fn, 7, workers=2) == [i * 10 for i in range(7)]


def test_a_stalled_worker_is_killed_and_its_tasks_run_here(monkeypatch):
    monkeypatch.setattr(workers, "STALL_S", 0.5)
    monkeypatch.setattr(workers, "STALL_FACTOR", 1)

    def fn(i):
        if i == 1 and _in_child():
            time.sleep(600)
        return -i

    t = time.perf_counter()
    assert map_forked(fn, 5, workers=2) == [0, -1, -2, -3, -4]
    assert time.perf_counter() - t < 30


def test_a_result_that_does_not_pickle_is_computed_here():
    got = map_forked(lambda i: (lambda: i), 4, workers=2)
    assert [f() for f in got] == [0, 1, 2, 3]


def test_a_worker_warning_shows_here_once():
    def fn(i):
        warnings.warn("priced in a worker", UserWarning)
        return i

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        map_forked(fn, 4, workers=2)
    assert [str(w.message) for w in caught] == ["priced in a worker"] * 4       # 1 here, 3 sent


def test_serial_where_fork_is_unsafe(monkeypatch):
    monkeypatch.setenv(workers.ENV, "4")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert "thread" in fork_blocker() and search_workers(50) == 1
    finally:
        stop.set()
        t.join()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    if threading.active_count() == 1:
        assert "launched job" in fork_blocker()
    assert search_workers(50) == 1


def test_how_many_workers(monkeypatch, forks):
    monkeypatch.setenv(workers.ENV, "3")
    assert search_workers(50) == 3 and search_workers(3) == 2 and search_workers(1) == 1
    monkeypatch.setenv(workers.ENV, "1")
    assert search_workers(50) == 1
    monkeypatch.delenv(workers.ENV)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert search_workers(50) == 4 and search_workers(2 * workers.MIN_TASKS) == 2 and search_workers(5) == 1


@pytest.mark.parametrize("bad", ["0", "two", "-1"])
def test_a_bad_worker_count_names_the_valid_values(monkeypatch, bad):
    monkeypatch.setenv(workers.ENV, bad)
    with pytest.raises(ConfigError, match="AUTOSHARD_SEARCH_WORKERS.*positive integer"):
        search_workers(50)
