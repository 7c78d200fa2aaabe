"""The shared-memory transport of same-host CPU collectives (autoshard.runtime.shm):
the same results as the process group's own collectives on every dim, dtype and size
(several rounds through a small slot), bitwise identical sums on every rank, the same
ledger, the process-group path when turned off, and a timeout or a dead peer turned
into the error a process-group collective raises."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from dist_pool import get_pool


def _inputs(rank: int, shape, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _fresh_group(world: int):
    """A new group over every rank: its channel is set up now, with the environment's slot size."""
    import torch.distributed as dist

    return dist.new_group(list(range(world))).group_name


def _compare(rank, world, slot_mb):
    import torch.distributed as dist

    from autoshard.runtime import collectives as C
    from autoshard.runtime import shm

    torch.set_num_threads(1)
    os.environ["AUTOSHARD_SHM_SLOT_MB"] = str(slot_mb)
    try:
        g = _fresh_group(world)
        ch = shm.channel(g, torch.zeros(1))
    finally:
        del os.environ["AUTOSHARD_SHM_SLOT_MB"]
    out = {"channel": ch is not None, "slot": ch.slot if ch else None, "checks": []}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for shape in ((3, 8, 12), (1, 4, 2048), (2048,)):
            xs = [_inputs(r, shape, dtype) for r in range(world)]
            x = xs[rank]
            tol = 0.07 if dtype == torch.bfloat16 else 1e-5        # another order of the sum (> 2 ranks)
            for op in ("sum", "max"):
                got = C.all_reduce(x, g, op)
                os.environ["AUTOSHARD_SHM"] = "0"
                ref = C.all_reduce(x, g, op)
                del os.environ["AUTOSHARD_SHM"]
                exact = torch.stack(xs).sum(0) if op == "sum" else torch.stack(xs).amax(0)
                same = torch.equal(got, ref) if (op == "max" or world == 2 or not dtype.is_floating_point) \
                    else torch.allclose(got.float(), ref.float(), rtol=0, atol=tol)
                mine = got.float().double().sum().item()
                out["checks"].append((f"all_reduce {op} {dtype} {shape}", same,
                                      torch.allclose(got.float(), exact.float(), rtol=0, atol=tol), mine))
            for dim in range(len(shape)):
                if shape[dim] % world:
                    continue
                for transport in ("shm", "process group"):       # both lay the blocks out alike
                    os.environ["AUTOSHARD_SHM"] = "1" if transport == "shm" else "0"
                    got = C.all_gather(x, dim, g)
                    out["checks"].append((f"all_gather {dtype} {shape} dim {dim} ({transport})",
                                          torch.equal(got, torch.cat(xs, dim)), True, None))
                    if dtype == torch.int64:
                        rs = C.reduce_scatter(x, dim, g)
                        want = torch.stack(xs).sum(0).chunk(world, dim)[rank]
                        out["checks"].append((f"reduce_scatter {dtype} {shape} dim {dim} ({transport})",
                                              torch.equal(rs, want), True, None))
                    del os.environ["AUTOSHARD_SHM"]
    dist.barrier()
    return out


@pytest.mark.parametrize("world,slot_mb", [(2, 4), (4, 0.004)], ids=["p2-one-round", "p4-many-rounds"])
def test_shm_collectives_equal_the_process_groups(world, slot_mb):
    res = get_pool(world, timeout=300).run(_compare, slot_mb)
    assert all(r["channel"] for r in res), "ranks of one host must get a channel"
    if slot_mb < 1:
        assert res[0]["slot"] == 4096          # (1, 4, 2048) fp32 takes 8 rounds of a slot per rank
    for r in res:
        bad = [name for name, same, close, _ in r["checks"] if not (same and close)]
        assert not bad, bad
    # a sum is bitwise the same on every rank (each sums the slots in rank order)
    for i, (name, _, _, total) in enumerate(res[0]["checks"]):
        if total is not None:
            assert all(r["checks"][i][3] == total for r in res), name


def _ledger_and_fallback(rank, world):
    from autoshard.runtime import collectives as C
    from autoshard.runtime import shm

    torch.set_num_threads(1)
    g = _fresh_group(world)
    x = torch.ones(4, 6)
    with C.CommLedger() as on:
        C.all_reduce(x, g, "sum")
        C.all_gather(x, 1, g)
        C.reduce_scatter(x, 0, g)
    os.environ["AUTOSHARD_SHM"] = "0"
    try:
        off = shm.channel(g, x)
        with C.CommLedger() as led_off:
            C.all_reduce(x, g, "sum")
            C.all_gather(x, 1, g)
            C.reduce_scatter(x, 0, g)
    finally:
        del os.environ["AUTOSHARD_SHM"]
    return {"on": on.by_kind(), "off": led_off.by_kind(), "channel_off": off,
            "meta": shm.channel(g, torch.ones(2, device="meta"))}


def test_shm_is_counted_alike_and_can_be_turned_off():
    r0, _ = get_pool(2, timeout=300).run(_ledger_and_fallback)
    assert r0["on"] == r0["off"] and sum(n for n, _ in r0["on"].values()) == 3
    assert r0["channel_off"] is None and r0["meta"] is None


def _late_peer(rank, world):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from autoshard.runtime import collectives as C

    torch.set_num_threads(1)
    g = _fresh_group(world)
    C.all_reduce(torch.ones(3), g, "sum")              # sets the channel up on both ranks
    store = c10d._get_default_store()
    res = {}
    if rank == 0:                                      # rank 1 never joins this one
        os.environ["AUTOSHARD_TIMEOUT"] = "1"
        t0 = time.monotonic()
        try:
            C.all_reduce(torch.ones(3), g, "sum")
        except dist.DistBackendError as e:
            res["error"] = str(e)
        finally:
            del os.environ["AUTOSHARD_TIMEOUT"]
        res["seconds"] = time.monotonic() - t0
        store.set("test_shm/late_done", "1")
    else:
        store.wait(["test_shm/late_done"])
    dist.barrier()
    return res


def test_shm_wait_times_out_with_the_process_groups_error():
    r0, r1 = get_pool(2, timeout=300).run(_late_peer)
    assert "rank(s) [1] of the group did not arrive within 1 s (AUTOSHARD_TIMEOUT)" in r0["error"], r0
    assert r0["seconds"] < 5, r0["seconds"]
    assert r1 == {}


def test_a_zombie_or_reaped_peer_is_not_alive():
    from autoshard.runtime.shm import _alive

    assert _alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    for _ in range(200):                               # exited, not yet reaped: a zombie
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.02)
    assert not _alive(p.pid)
    p.wait()
    assert not _alive(p.pid)
