"""Collective misuse is an error, not a hang: a collective entry point called on
one rank only raises CollectiveError on that rank, naming the call and the ranks
that did not arrive (autoshard.runtime.collectives.entry_barrier)."""

from __future__ import annotations

import os
import time

import torch

import models
from dist_pool import get_pool


def _save_on_rank0_only(rank, world, out_dir):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import autoshard
    from autoshard.ir.errors import CollectiveError

    torch.set_num_threads(1)
    model = models.build("llama")
    inputs = models.batch("llama")
    sharded = autoshard.shard(model, mode="1d", example_inputs=inputs,
                              captured=models.shared_capture("llama", model, inputs))
    # no dist.barrier here: under load one rank's capture can lag the other past gloo's own timeout
    store = c10d._get_default_store()
    res = {}
    if rank == 0:
        t0 = time.monotonic()
        os.environ["AUTOSHARD_ENTRY_TIMEOUT"] = "6"      # default 20 s: the wait for rank 1 is the test's cost
        try:
            sharded.save_pretrained(out_dir)
            res["error"] = None
        except CollectiveError as e:
            res["error"] = str(e)
        finally:
            del os.environ["AUTOSHARD_ENTRY_TIMEOUT"]     # the pool's worker lives on
        res["seconds"] = time.monotonic() - t0
        store.set("test_collectives/rank0_done", "1")
    else:
        store.wait(["test_collectives/rank0_done"])
    dist.barrier()
    sharded.save_pretrained(out_dir)        # then called on both ranks: works (the misuse left no count behind)
    res["saved"] = (out_dir / "model.safetensors").exists() if rank == 0 else None
    return res


def test_save_pretrained_on_one_rank_raises(tmp_path, monkeypatch):
    r0, r1 = get_pool(2, timeout=300).run(_save_on_rank0_only, tmp_path)
    assert r0["error"] is not None, "rank 0 alone must not succeed"
    assert "save_pretrained is collective" in r0["error"] and "rank(s) [1] of 2 did not enter" in r0["error"]
    assert r0["seconds"] < 30, r0["seconds"]
    assert r0["saved"] is True and r1 == {"saved": None}


def _entry_barrier_all(rank, world):
    from autoshard.runtime.collectives import entry_barrier

    t0 = time.monotonic()
    for _ in range(3):
        entry_barrier("unit_test_call", timeout=10)
    return time.monotonic() - t0


def test_entry_barrier_passes_when_every_rank_enters():
    assert all(s < 5 for s in get_pool(2).run(_entry_barrier_all))
