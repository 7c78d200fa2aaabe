"""Ranks of a multi-GPU job run one at a time in this process, on torch's fake process
group (``FakeStore``, backend ``"fake"``: a collective returns at once, moves nothing),
with every torch.distributed call recorded: what a second GPU would show, without one.

    with fake_rank(3, 8) as calls:
        sharded = autoshard.shard(model, mode="1d", dp=2, captured=cap, device="meta", seed=0)
        step(sharded, inputs)
    calls.ops          # [Call(op, label, ranks, dtype, numel, device), ...] in order
    calls.made         # the groups this rank created a communicator for (member groups)

``device="meta"`` stands for the rank's GPU: the tensors have shapes and dtypes and no
values, so a step costs microseconds, and a collective handed a CPU tensor shows. A
CPU run (``device="cpu"``) has values (garbage where a collective would have filled them)
and runs under ``torch.autocast("cpu")``: what travels in which dtype.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

_OPS = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
        "reduce_scatter_tensor", "all_to_all_single", "broadcast", "barrier", "all_gather_object",
        "broadcast_object_list", "batch_isend_irecv")     # not isend / irecv: P2POp checks them by identity


@dataclass(frozen=True)
class Call:
    op: str
    label: str                 # the group's description (mesh axes), "default_pg" for WORLD
    ranks: tuple[int, ...]     # the group's global ranks, in group order
    dtype: str
    numel: int
    device: str

    def relative(self) -> tuple:
        """What must be the same on every rank at this position: op, group (its axes), dtype, size."""
        return self.op, self.label, self.dtype, self.numel


def _desc(pg) -> str:
    """A group's description: the mesh axes it was made for (``"default_pg"``: WORLD)."""
    return getattr(pg, "group_desc", "") or ""


def _tensors(args, kwargs):
    out = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    out.append(x)
                elif isinstance(x, dist.P2POp):
                    out.append(x.tensor)
    return out


def _group_of(op: str, args, kwargs):
    g = kwargs.get("group")
    if g is None and op == "batch_isend_irecv" and args and args[0]:
        g = args[0][0].group
    return g if g is not None else dist.group.WORLD


# autoshard's collective ops as a dispatch mode sees them on meta (their fake kernels run
# there, not the collectives): op -> (the collective each forward runs, where its group is)
_GRAPH_OPS = {"all_reduce": ("all_reduce", 1), "all_gather": ("all_gather", 2), "reduce_scatter": ("reduce_scatter", 2),
              "reduce_from": ("all_reduce", 1), "all_reduce_both": ("all_reduce", 1),
              "gather_from": ("all_gather", 2), "gather_partial": ("all_gather", 2),
              "reduce_scatter_to": ("reduce_scatter", 2), "ring_shift": ("send_recv", 1),
              "all_gather_two": ("all_gather", 2), "reduce_scatter_two": ("reduce_scatter", 2)}


class _GraphOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records autoshard's collective ops on meta tensors (where only their shapes run)."""

    def __init__(self, calls: "Calls"):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func.__name__.split(".")[0]
        if ns == "autoshard" and name in _GRAPH_OPS:
            kind, at = _GRAPH_OPS[name]
            if name.endswith("_two"):
                self.calls.graph_op(kind, args[2], args[0])
                self.calls.graph_op(kind, args[5], args[3])
            else:
                self.calls.graph_op(kind, args[at], args[0])
        return func(*args, **kwargs)


class Calls:
    """The torch.distributed calls and the groups made while :func:`fake_rank` is open."""

    def __init__(self, rank: int):
        self.rank = rank
        self.ops: list[Call] = []
        self.made: list[tuple[int, ...]] = []      # member groups created (a communicator each)
        self.asked = 0                             # new_group calls (every rank makes each)

    def graph_op(self, kind: str, group: str, x: torch.Tensor) -> None:
        from torch.distributed import distributed_c10d as c10d

        if group.startswith("autoshard-sim:"):
            return
        if x.device.type != "meta":     # a real tensor: its collective runs and is recorded at torch.distributed
            return
        pg = c10d._resolve_process_group(group)
        label = group.split("/")[2] if group.startswith("autoshard/") else getattr(pg, "group_desc", "")
        self.ops.append(Call(kind, label, tuple(dist.get_process_group_ranks(pg)),
                             str(x.dtype).removeprefix("torch."), x.numel(), x.device.type))

    def record(self, op: str, args, kwargs) -> None:
        pg = _group_of(op, args, kwargs)
        ts = _tensors(args, kwargs)
        t = ts[0] if ts else None
        self.ops.append(Call(op, _desc(pg), tuple(dist.get_process_group_ranks(pg)),
                             str(t.dtype).removeprefix("torch.") if t is not None else "",
                             sum(x.numel() for x in ts), t.device.type if t is not None else ""))


@contextlib.contextmanager
def fake_rank(rank: int, world: int, backend: str = "fake", meta: bool = True):
    """Rank ``rank`` of a ``world``-rank job on the fake process group, every collective
    and group creation recorded (yields :class:`Calls`); autoshard's per-job caches of
    groups are emptied on the way out (the next rank is a new job in this process).
    ``meta``: the rank's device is meta (standing for its GPU): the collectives' tensors
    are handed to the default group on it, and autoshard's collective ops, whose fake
    kernels run there, are recorded as they are dispatched."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autoshard.runtime import collectives as C
    from autoshard.runtime import device as D
    from autoshard.runtime import groups as G

    calls = Calls(rank)
    saved = {op: getattr(dist, op) for op in _OPS if hasattr(dist, op)}
    new_group = dist.new_group

    def wrap(op, fn):
        def recorded(*args, **kwargs):
            calls.record(op, args, kwargs)
            return fn(*args, **kwargs)
        return recorded

    def counted_new_group(ranks=None, *args, **kwargs):
        calls.asked += 1
        pg = new_group(ranks, *args, **kwargs)
        if ranks is not None and rank in ranks:
            calls.made.append(tuple(ranks))
        return pg

    # no heartbeat: the fake store shows no peer beating, and the watcher would end this process
    heartbeat = os.environ.get("AUTOSHARD_HEARTBEAT")
    os.environ["AUTOSHARD_HEARTBEAT"] = "0"
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world)
    from autoshard.launch import pipeline

    holders = (D, G, pipeline)      # comm_device as each module holds it
    saved_comm = [h.comm_device for h in holders]
    if meta:
        for h in holders:
            h.comm_device = lambda: torch.device("meta")
    mode = _GraphOps(calls) if meta else contextlib.nullcontext()
    try:
        for op, fn in saved.items():
            setattr(dist, op, wrap(op, fn))
        dist.new_group = counted_new_group
        with mode:
            yield calls
    finally:
        for op, fn in saved.items():
            setattr(dist, op, fn)
        dist.new_group = new_group
        for h, fn in zip(holders, saved_comm):
            h.comm_device = fn
        dist.destroy_process_group()
        if heartbeat is None:
            os.environ.pop("AUTOSHARD_HEARTBEAT", None)
        else:
            os.environ["AUTOSHARD_HEARTBEAT"] = heartbeat
        G._GROUPS.clear()
        getattr(G, "_BY_RANKS", {}).clear()
        C._BALANCED.clear()


def step(sharded, inputs: dict, autocast: bool = False, calls: Calls | None = None) -> None:
    """One training step: forward, backward (the bucketed gradient sync), the global
    gradient norm's clip and AdamW, no value read on the host (``calls.forward``: the
    calls up to the end of forward)."""
    from autoshard.training.train import clip_grad_norm_

    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3, foreach=False)
    ctx = torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        loss = sharded(**inputs).loss
    if calls is not None:
        calls.forward = len(calls.ops)
    loss.backward()
    clip_grad_norm_(sharded, 1.0)
    opt.step()


def same_program(runs: dict[int, Calls]) -> list[str]:
    """What differs between the ranks' call sequences: a rank whose sequence of (op, axes,
    dtype, size) is not rank 0's, or a call whose group's members hold another group at
    that position (their collectives would not meet)."""
    bad = []
    ranks = sorted(runs)
    ref = [c.relative() for c in runs[ranks[0]].ops]
    for r in ranks[1:]:
        mine = [c.relative() for c in runs[r].ops]
        if mine != ref:
            at = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))
            bad.append(f"rank {r} differs from rank {ranks[0]} at call {at}: "
                       f"{mine[at] if at < len(mine) else None} vs {ref[at] if at < len(ref) else None}")
    for r in ranks:
        for i, c in enumerate(runs[r].ops):
            if r not in c.ranks:
                bad.append(f"rank {r} call {i} ({c.op}) on a group without it: {c.ranks}")
            for m in c.ranks:
                if m in runs and i < len(runs[m].ops) and runs[m].ops[i].ranks != c.ranks:
                    bad.append(f"call {i} ({c.op}, {c.label}): rank {r} on {c.ranks}, its member {m} on "
                               f"{runs[m].ops[i].ranks}")
                    break
    return bad[:10]
