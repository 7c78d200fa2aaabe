"""A relaunch rebuilds each rank's sharded module from its launch-cache entry
(autoshard/launch/launch_cache.py): no capture, no planning, no rewrite; the same graph
code, bitwise the same logits, loss and gradients as the launch that wrote it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

import models
from dist_pool import get_pool


def _launch(name: str, mode: str, inputs: dict, depth=None):
    """shard() of a fresh ``name`` model (same seed), one forward + backward: (module,
    logits, loss, grads, capture_shared calls)."""
    import autoshard
    import autoshard.launch.pipeline as api      # its capture stage makes the shared capture
    from autoshard.launch import capture_share

    calls = []
    real = api.capture_shared
    api.capture_shared = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    capture_share.forget_loaded()           # as a new process would
    try:
        sm = autoshard.shard(models.build(name), mode=mode, depth=depth, example_inputs=inputs)
    finally:
        api.capture_shared = real
    out = sm(**inputs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in sm.named_parameters() if p.grad is not None}
    return sm, out.logits.detach(), out.loss.detach(), grads, len(calls)


def _twice(rank, world, name, mode, depth=None, drop_rank=None):
    """Two launches into one fresh cache; ``drop_rank``: that rank's entry removed
    between them (every rank must then take the full path)."""
    torch.set_num_threads(1)
    saved = os.environ.get("AUTOSHARD_CACHE")
    cache = tempfile.mkdtemp(prefix=f"launch-{rank}-") if rank == 0 else None
    import torch.distributed as dist

    box = [cache]
    dist.broadcast_object_list(box, src=0)
    os.environ["AUTOSHARD_CACHE"] = box[0]
    try:
        inputs = models.batch(name)
        first = _launch(name, mode, inputs, depth)
        folder = Path(box[0]) / "launch"
        dist.barrier()
        entries = len(list(folder.glob("*.bin")))
        mine = folder / f"{_key_of(name, inputs, mode, depth)}.bin"
        has_mine = mine.exists()
        if rank == drop_rank:
            mine.unlink()
        dist.barrier()
        second = _launch(name, mode, inputs, depth)
        dense = models.build(name)
        ref = dense(**inputs)
        return {"captures": (first[4], second[4]), "code": first[0]._gm.code == second[0]._gm.code,
                "logits": torch.equal(first[1], second[1]), "loss": torch.equal(first[2], second[2]),
                "grads": sorted(first[3]) == sorted(second[3]) and all(torch.equal(first[3][k], second[3][k])
                                                                       for k in first[3]),
                "dense_loss": abs(float(second[2]) - float(ref.loss.detach())), "entries": entries, "has_mine": has_mine}
    finally:
        if saved is None:
            os.environ.pop("AUTOSHARD_CACHE", None)
        else:
            os.environ["AUTOSHARD_CACHE"] = saved


def _key_of(name, inputs, mode, depth):
    import torch.distributed as dist

    from autoshard.launch.pipeline import launch_key
    from autoshard.planning.cost import default_cluster
    from autoshard.policies import make_policy

    world = dist.get_world_size()
    if mode == "auto":
        layout = dict(policy="auto", cluster=repr(default_cluster()), depth=depth, dp=1)
    else:
        pol = make_policy(mode, world, depth, 1)
        layout = dict(policy=type(pol).__qualname__, mesh=(pol.mesh.axes, pol.mesh.sizes))
    return launch_key(models.build(name), inputs, world, dist.get_rank(), gather_logits=True,
                      dropout="sharded", **layout)


@pytest.mark.parametrize("name,mode,world", [("llama", "1d", 2), ("gpt2", "2d", 4), ("llama-v131", "1d-sp", 2),
                                            ("llama", "auto", 2)])
def test_a_relaunch_rebuilds_the_same_module_without_capturing(name, mode, world):
    """Second launch: no capture on any rank, the same generated code, bitwise the same
    logits, loss and every local gradient (tied GPT-2 weights, a vocabulary padded to
    the split, sequence parallelism, the layout mode="auto" chose: no search either),
    and the loss still the dense model's."""
    for r in get_pool(world).run(_twice, name, mode):
        assert r["captures"] == (1, 0), r
        assert r["entries"] == world and r["has_mine"]          # one entry per rank
        assert r["code"] and r["logits"] and r["loss"] and r["grads"], r
        assert r["dense_loss"] < 1e-5


def test_a_rank_without_its_entry_sends_every_rank_down_the_full_path():
    """Rank 1's entry gone: every rank captures, plans and rewrites again (one small
    all-reduce decides it; nobody waits in a collective the others skip)."""
    for r in get_pool(2).run(_twice, "llama", "1d", None, 1):
        assert r["captures"] == (1, 1), r
        assert r["code"] and r["logits"] and r["loss"] and r["grads"], r


def test_keys_entries_and_corruption(tmp_path, monkeypatch):
    """The key follows the layout, rank, world size and options; an entry round-trips;
    a corrupt one is removed and reads as absent; AUTOSHARD_LAUNCH_CACHE=off turns it off alone,
    AUTOSHARD_CACHE=off with the capture cache."""
    from autoshard.launch import launch_cache as lc

    k = lc.launch_key("cap", policy="OneD", mesh=(("tp",), (2,)), world=2, rank=0, dropout="sharded")
    assert k == lc.launch_key("cap", policy="OneD", mesh=(("tp",), (2,)), world=2, rank=0, dropout="sharded")
    for change in (dict(rank=1), dict(world=4), dict(mesh=(("tp",), (4,))), dict(dropout="dense"),
                   dict(policy="Summa")):
        kw = dict(policy="OneD", mesh=(("tp",), (2,)), world=2, rank=0, dropout="sharded") | change
        assert lc.launch_key("cap", **kw) != k, change
    assert lc.launch_key("other capture", policy="OneD", mesh=(("tp",), (2,)), world=2, rank=0,
                         dropout="sharded") != k
    from autoshard.launch import cache_dir

    assert len(cache_dir.source_hash()) == 64
    monkeypatch.setenv("AUTOSHARD_CACHE", str(tmp_path))
    entry = lc.LaunchEntry(graphs={}, tensors={"c": ("const", torch.arange(3))}, plan=None, facts={"x": 1},
                           groups={"tp": "1"})
    lc.write(k, entry)
    back = lc.read(k)
    assert back.facts == {"x": 1} and torch.equal(back.tensors["c"][1], torch.arange(3))
    f = tmp_path / "launch" / f"{k}.bin"
    f.write_bytes(f.read_bytes()[:-10] + b"x" * 10)
    assert lc.read(k) is None and not f.exists()
    lc.write(k, entry)
    monkeypatch.setenv("AUTOSHARD_LAUNCH_CACHE", "off")          # this cache alone off
    assert not lc.enabled() and lc.read(k) is None and f.exists()
    monkeypatch.delenv("AUTOSHARD_LAUNCH_CACHE")
    assert lc.enabled() and lc.read(k) is not None
    f.unlink()
    monkeypatch.setenv("AUTOSHARD_CACHE", "off")
    lc.write(k, entry)
    assert lc.read(k) is None and not f.exists()


def test_the_self_check_reads_a_shape_only_record():
    """A rebuilt graph keeps of each capture value only its shape (sympy sizes): the
    first-call self-check computes the same promised local shape from it."""
    import sympy

    from autoshard.launch.launch_cache import ShapeOnly
    from autoshard.ir.mesh import Mesh
    from autoshard.runtime.selfcheck import expected_local_shape
    from autoshard.ir.spec import ShardSpec

    b, s = sympy.symbols("s0 s1", integer=True, positive=True)
    mesh = Mesh(axes=("tp",), sizes=(2,))
    spec = ShardSpec(dims=((), (), ("tp",)))
    assert expected_local_shape(ShapeOnly((b, s, 64)), spec, mesh, {b: 4, s: 8}) == (4, 8, 32)
    assert expected_local_shape(ShapeOnly((b, s * 2, 64)), spec, mesh, {b: 4, s: 8}) == (4, 16, 32)
    assert expected_local_shape(ShapeOnly((b, s, 64)), spec, mesh, {b: 4}) is None      # s unbound
    assert expected_local_shape(torch.empty(4, 8, 64), spec, mesh, {}) == (4, 8, 32)


def test_a_graph_with_guards_but_no_guard_code_leaves_no_entry(tmp_path, monkeypatch):
    """A capture loaded from the program format calls export's ``_guards_fn`` but kept no
    code to rebuild it from: no entry is stored (the next launch goes the full way and
    its inputs stay guarded), and storing never raises."""
    from types import SimpleNamespace

    from autoshard.launch import launch_cache as lc

    root = torch.nn.Module()
    root._guards_fn = torch.nn.Identity()
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.call_module("_guards_fn", (x,))
    g.output(x)
    gm = torch.fx.GraphModule(root, g)
    plan = SimpleNamespace(params=())
    with pytest.raises(ValueError, match="no guard code"):
        lc.entry_of(gm, plan, {}, {"guards": ()})
    assert lc.entry_of(gm, plan, {}, {"guards": ("code", ())}).graphs[""][1][1][1] == "_guards_fn"
    monkeypatch.setenv("AUTOSHARD_CACHE", str(tmp_path))
    lc.store("k", gm, plan, {}, {"guards": ()})
    assert not (tmp_path / "launch" / "k.bin").exists()


def _refused(rank, world):
    """Two launches into a cache folder of mode 0o777 (rank 0 makes it): (capture_shared
    calls of each launch, the files left in it)."""
    import warnings

    import torch.distributed as dist

    torch.set_num_threads(1)
    saved = os.environ.get("AUTOSHARD_CACHE")
    box = [tempfile.mkdtemp(prefix="refused-") if rank == 0 else None]
    if rank == 0:
        os.chmod(box[0], 0o777)
    dist.broadcast_object_list(box, src=0)
    os.environ["AUTOSHARD_CACHE"] = box[0]
    try:
        inputs = models.batch("llama")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first = _launch("llama", "1d", inputs)
            second = _launch("llama", "1d", inputs)
        dist.barrier()
        return {"captures": (first[4], second[4]), "files": sorted(str(p) for p in Path(box[0]).rglob("*")),
                "loss": torch.equal(first[2], second[2])}
    finally:
        os.environ["AUTOSHARD_CACHE"] = saved if saved is not None else os.environ.pop("AUTOSHARD_CACHE")


def test_a_refused_folder_runs_every_rank_uncached():
    """A cache folder others can write: no rank reads or writes an entry (both launches
    capture), none stops, and the ranks agree on the path."""
    for r in get_pool(2).run(_refused):
        assert r["captures"] == (1, 1) and r["files"] == [] and r["loss"], r
