"""A relaunch (launch-cache hit: autoshard/launch/launch_cache.py) looks to the user
exactly as the first launch did, on every architecture of the matrix (tests/arch_models.py)
at 1d on 2 ranks and 2d on 4: the same ``state_dict`` keys and values (non-persistent
buffers stay out of it), ``named_parameters`` / ``named_buffers`` with their shapes,
dtypes and ``requires_grad``, the same ``config``; ``load_state_dict`` of a dense
model's state dict works on both and both then give the dense logits; and
``save_pretrained`` writes the same bytes.

Both launches share the session's capture cache (the first one loads the capture
rank 0 exported, no search); this rank's launch entry is removed first so the first
launch goes the full way and writes the entry the second one reads.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import pytest
import torch

import models
from arch_matrix import EXPECTED_REFUSED
from arch_models import ARCHS
from dist_pool import get_pool

SAMPLE = ("llama", "gpt2", "bert", "mixtral", "t5")     # the cells `make test` runs; the rest are extended


def _launch(name: str, mode: str, inputs: dict):
    """``shard()`` of a fresh ``name`` model as a new process would: (module, captures made)."""
    import autoshard
    import autoshard.launch.pipeline as api      # its capture stage makes the shared capture
    from autoshard.launch import capture_share

    calls = []
    real = api.capture_shared
    api.capture_shared = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    capture_share.forget_loaded()
    try:
        sm = autoshard.shard(models.build(name), mode=mode, example_inputs=inputs)
    finally:
        api.capture_shared = real
    return sm, len(calls)


def _entry_path(name: str, mode: str, inputs: dict) -> Path:
    """This rank's launch-cache entry for the launches :func:`_launch` makes."""
    import torch.distributed as dist

    from autoshard.launch import cache_dir
    from autoshard.launch.pipeline import launch_key
    from autoshard.policies import make_policy

    world = dist.get_world_size()
    pol = make_policy(mode, world, None, 1)
    key = launch_key(models.build(name), inputs, world, dist.get_rank(), gather_logits=True, dropout="sharded",
                      policy=type(pol).__qualname__, mesh=(pol.mesh.axes, pol.mesh.sizes))
    return cache_dir.folder("launch") / f"{key}.bin"


def _face(sm) -> dict:
    """What a user sees of a module without calling it."""
    sd = sm.state_dict()
    return {
        "state_dict": [(k, tuple(v.shape), v.dtype) for k, v in sd.items()],
        "parameters": [(n, tuple(p.shape), p.dtype, p.requires_grad)
                       for n, p in sm.named_parameters(remove_duplicate=False)],
        "buffers": [(n, tuple(b.shape), b.dtype, n in sd) for n, b in sm.named_buffers(remove_duplicate=False)],
        "config": None if sm.config is None else sm.config.to_dict(),
        "training": sm.training,
        "limits": sm.limits,
        "recipe": None if sm.recipe is None else (sm.recipe.model_class, sm.recipe.policy.name, sm.recipe.training,
                                                  sm.recipe.batch_size, sm.recipe.seq_len),
        "signatures": sm.signatures,
    }


def _saved(sm, rank: int) -> dict:
    """``save_pretrained`` into a fresh folder (collective): {file: sha256} on rank 0."""
    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="relaunch-save-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    sm.save_pretrained(box[0])
    if rank != 0:
        return {}
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(Path(box[0]).iterdir())}


def _relaunch_faces(rank: int, world: int, name: str, mode: str) -> dict:
    """First launch vs relaunch on this rank: what differs between them (empty: nothing)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    inputs = models.batch(name)
    _entry_path(name, mode, inputs).unlink(missing_ok=True)
    dist.barrier()
    first, first_captures = _launch(name, mode, inputs)
    second, second_captures = _launch(name, mode, inputs)
    problems = {}
    if second_captures != 0:
        problems["relaunch captured"] = (first_captures, second_captures)
    a, b = _face(first), _face(second)
    for k in a:
        if a[k] != b[k]:
            problems[k] = [x for x in a[k] if x not in b[k]] if isinstance(a[k], list) else (a[k], b[k]), \
                [x for x in b[k] if x not in a[k]] if isinstance(b[k], list) else None
    sa, sb = first.state_dict(), second.state_dict()
    if any(not torch.equal(sa[k], sb[k]) for k in sa if k in sb):
        problems["state_dict values"] = [k for k in sa if k in sb and not torch.equal(sa[k], sb[k])]
    dense = models.build(name, seed=1)          # other weights: a load that did nothing would show
    ref = dense(**inputs).logits.detach()
    for which, sm in (("first", first), ("relaunch", second)):
        try:
            sm.load_state_dict(dense.state_dict())
        except Exception as e:  # noqa: BLE001 - the report names what failed, on which launch
            problems[f"{which} load_state_dict"] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        got = sm(**inputs).logits.detach()
        try:
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        except AssertionError as e:
            problems[f"{which} logits after load"] = str(e)[:300]
    if _saved(first, rank) != _saved(second, rank):
        problems["save_pretrained bytes"] = True
    return problems


def _cells(mode: str) -> list:
    out = []
    for arch in ARCHS:
        if (arch, mode) in EXPECTED_REFUSED:
            continue
        marks = [] if arch in SAMPLE else [pytest.mark.extended]
        if mode == "2d":
            marks.append(pytest.mark.slow)
        out.append(pytest.param(arch, mode, marks=marks, id=f"{arch}-{mode}"))
    return out


@pytest.mark.parametrize("name,mode", _cells("1d") + _cells("2d"))
def test_a_relaunch_looks_like_the_first_launch(name, mode):
    """Every user-visible point of a relaunched module equals the first launch's."""
    world = 2 if mode == "1d" else 4
    for rank, problems in enumerate(get_pool(world).run(_relaunch_faces, name, mode)):
        assert not problems, f"rank {rank}: {problems}"
