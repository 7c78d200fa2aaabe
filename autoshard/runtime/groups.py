"""Process groups over a mesh's axes, created once and cached."""

from __future__ import annotations

import datetime

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..ir.mesh import Mesh
from . import collectives as C
from .device import comm_device
from .timeout import timeout_seconds

__all__ = ["mesh_group", "axes_label", "group_alias", "plan_groups", "ranks_group", "copy_group", "stride_group", "copy_sync_hooks"]


def axes_label(axes) -> str:
    """The key a plan's collectives use for the group over ``axes``: ``"dep,row"``."""
    return ",".join(axes)


_GROUPS: dict = {}


def mesh_group(mesh: Mesh, axes: tuple[str, ...], rank: int, balanced: bool = False):
    """This rank's process group over ``axes`` of ``mesh``, created once per default
    group, mesh and axes (collectively: every rank creates every group of that
    axes in the same order), with the ``AUTOSHARD_TIMEOUT`` timeout (``new_group``
    would take torch's default, 30 min for gloo, 10 for NCCL). ``balanced``: a group of
    its own whose sequence blocks are in context parallelism's balanced order
    (:func:`~autoshard.runtime.collectives.mark_balanced`)."""
    key = (id(dist.group.WORLD), mesh, axes, balanced)
    if key not in _GROUPS:
        mine = None
        for ranks in mesh.all_groups(axes):
            pg = _group_of(tuple(ranks), axes, balanced)
            if rank in ranks:
                mine = pg
        if mine is not None:
            _register_alias(group_alias(mesh, axes, balanced), mine)
            if balanced:
                C.mark_balanced(mine.group_name)
                C.mark_balanced(group_alias(mesh, axes, balanced))
        _GROUPS[key] = mine
    return _GROUPS[key]


_BY_RANKS: dict = {}        # (id(WORLD), ranks in order) -> the group made for them (None: this rank is not in it)


def _group_of(ranks: tuple[int, ...], axes: tuple[str, ...], balanced: bool):
    """The process group over ``ranks`` (in that order): the default group where they are
    all its ranks in its order, the group already made for the same ranks (a mesh axis of
    size 1 next to another, ``(dp, tp)`` with ``dp = 1``), else a new one. Each group is a
    communicator with its own memory under NCCL: 1d with tp = world would otherwise hold
    a second copy of WORLD. A balanced cp group keeps a group of its own (its name marks
    the order)."""
    world = dist.group.WORLD
    if not balanced and ranks == tuple(range(dist.get_world_size())):
        return world
    key = (id(world), ranks)
    if not balanced and key in _BY_RANKS:
        return _BY_RANKS[key]
    pg = dist.new_group(list(ranks), group_desc=axes_label(axes), sort_ranks=False,
                        timeout=datetime.timedelta(seconds=timeout_seconds()))
    if not balanced:
        _BY_RANKS[key] = pg
    return pg


def group_alias(mesh: Mesh, axes: tuple[str, ...], balanced: bool = False) -> str:
    """The name every rank gives its own group over ``axes`` of ``mesh``:
    ``"autoshard/dp2xtp2/tp"``. c10d names each group by a counter or its members, so
    rank 0's row group and rank 2's have different names; the alias is one string on
    every rank, so the graphs of a plan are one program on every rank and
    ``torch.compile`` artifacts compiled by one rank serve the others (see
    docs/design.md, "Compiling once per host"). Registered with c10d by
    :func:`mesh_group`, so every lookup of a group by name accepts it."""
    shape = "x".join(f"{a}{s}" for a, s in zip(mesh.axes, mesh.sizes))
    return f"autoshard/{shape}/{axes_label(axes)}" + ("/balanced" if balanced else "")


def _register_alias(alias: str, pg) -> None:
    try:
        if c10d._resolve_process_group(alias) is pg:
            return
        from torch._C._distributed_c10d import _unregister_process_group

        _unregister_process_group(alias)      # a group of an earlier default group under the same alias
    except (RuntimeError, ValueError):
        pass
    from torch._C._distributed_c10d import _register_process_group

    _register_process_group(alias, pg)




def ranks_group(members: list[tuple[int, ...]], alias: str, rank: int) -> str | None:
    """Create one process group per rank tuple of ``members`` (collectively: every rank
    passes the same list) and register the one holding ``rank`` under ``alias`` (c10d
    resolves it, as the mesh groups' aliases). Returns ``alias``, or None where ``rank``
    is in none of them (pipeline parallelism's tied-tensor groups:
    :mod:`autoshard.pipeline_parallel`)."""
    mine = None
    for ranks in members:
        pg = dist.new_group(list(ranks), group_desc=alias, timeout=datetime.timedelta(seconds=timeout_seconds()))
        if rank in ranks:
            mine = pg
    if mine is None:
        return None
    _register_alias(alias, mine)
    return alias


def copy_group(mesh: Mesh, axes: tuple[str, ...], size: int, rank: int) -> str:
    """The name of this rank's group of ``size`` consecutive ranks along ``axes`` (the
    ranks holding copies of one kv head: docs/design.md, "Uneven widths"), every such
    group created once, collectively, in a rank-independent order."""
    return _sub_group(mesh, axes, f"copies{size}", lambda r: [r[i:i + size] for i in range(0, len(r), size)], rank)


def stride_group(mesh: Mesh, axes: tuple[str, ...], stride: int, rank: int) -> str:
    """The name of this rank's group of the ranks ``stride`` apart along ``axes`` (an
    expert-parallel group of ``size(axes) / stride`` ranks, one per block of experts, where
    ``stride`` consecutive ranks hold copies of each block: docs/design.md, "Expert
    parallelism"), every such group created once, collectively, in a rank-independent order."""
    return _sub_group(mesh, axes, f"stride{stride}", lambda r: [r[i::stride] for i in range(stride)], rank)


def _sub_group(mesh: Mesh, axes: tuple[str, ...], kind: str, parts, rank: int) -> str:
    """The alias of this rank's group among ``parts(ranks)`` of each group over ``axes``."""
    key = (id(dist.group.WORLD), mesh, axes, kind)
    if key not in _GROUPS:
        alias = f"{group_alias(mesh, axes)}/{kind}"
        for ranks in mesh.all_groups(axes):
            for sub in parts(tuple(ranks)):
                pg = dist.new_group(list(sub), group_desc=f"{axes_label(axes)}/{kind}", sort_ranks=False,
                                    timeout=datetime.timedelta(seconds=timeout_seconds()))
                if rank in sub:
                    _register_alias(alias, pg)
        _GROUPS[key] = alias
    return _GROUPS[key]


def copy_sync_hooks(plan, rank: int, params: dict) -> list:
    """Gradient hooks summing, for each parameter holding copies of a unit
    (:attr:`~autoshard.ir.plan.ParamPlan.pad_copies`), the gradients of every copy: those this
    rank holds, then over the ranks holding the others (an all-reduce through the ledger).
    Collective where a group is new (call on every rank)."""
    hooks = []
    for pp in plan.params:
        p = params.get(pp.name)
        if not pp.pad_copies or pp.pad_dim is None or p is None or not pp.trainable or not p.requires_grad:
            continue
        d, group = pp.pad_dim, pp.copy_group(plan.mesh)
        local = pp.local_shape(plan.mesh)[d]
        axes = pp.copy_axes(plan.mesh) if pp.spec.dims[d] else ()
        ways = plan.mesh.size(axes) if axes else 1
        held = pp.pad_copies // group        # copies of one unit on this rank, side by side (or a part of one)
        name = copy_group(plan.mesh, axes, group, rank) if group > 1 else None
        units = pp.pad_segments // ways if ways <= pp.pad_segments else 1

        def hook(grad, d=d, held=held, units=units, name=name, local=local):
            if held > 1:
                g = grad.unflatten(d, (units, held, local // (units * held)))
                grad = g.sum(d + 1, keepdim=True).expand_as(g).flatten(d, d + 2)
            return C.all_reduce(grad, name, "sum") if name is not None else grad
        hooks.append(p.register_hook(hook))
    return hooks


def plan_groups(plan, rank: int, mesh: Mesh | None = None) -> dict[str, str]:
    """Create (once per mesh and axes, collectively, in a rank-independent order)
    the process groups ``plan`` needs; return label -> the name of this rank's group,
    its :func:`group_alias` (one string on every rank; c10d resolves it). ``mesh``: the
    mesh the groups are made on, when the plan's own is one block of it (pipeline
    parallelism: the plan's mesh with ``pp`` outermost; ``rank`` is then the rank in it)."""
    labels = set()
    mesh = mesh if mesh is not None else plan.mesh
    for a in plan.mesh.axes:
        labels.add((a,))
    for n in plan.nodes:
        for _, steps in n.arg_steps:
            labels.update(s.axes for s in steps if s.axes)
        labels.update(s.axes for s in n.post if s.axes)
        if n.kernel is not None:
            labels.update(a for a in n.kernel.groups() if a)
    labels.update(p.grad_sync for p in plan.params if p.grad_sync)
    # the sequence's cp blocks in the balanced order: the cp group of its own
    balanced = mesh.cp > 1 and plan.cp_order == "balanced"
    out = {}
    for axes in sorted(labels, key=lambda a: (len(a), [mesh.axes.index(x) for x in a])):
        bal = balanced and axes == ("cp",)
        mesh_group(mesh, axes, rank, bal)
        out[axes_label(axes)] = group_alias(mesh, axes, bal)
    return out


def check_same_rng(world: int, what: str, why: str, fix: str) -> None:
    """Raise unless every rank's default generator is in the same state (one small
    all-gather; every rank reaches the same verdict). Dropout masks and sampled tokens
    come from it: ``what`` needs it, ``why`` says what breaks, ``fix`` where to seed."""
    import hashlib

    import torch
    import torch.distributed as dist

    from ..ir.errors import ConfigError

    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    on_gpu = comm_device().type == "cuda"
    if on_gpu:
        h.update(torch.cuda.get_rng_state().numpy().tobytes())
    mine = torch.tensor([int.from_bytes(h.digest()[:7], "big")], dtype=torch.int64, device=comm_device())
    table = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(table, mine)
    groups: dict[int, list[int]] = {}
    for r, t in enumerate(table):
        groups.setdefault(int(t), []).append(r)
    if len(groups) > 1:
        raise ConfigError(f"{what} and the ranks' random generators differ (ranks "
                          + " | ".join(str(rs) for rs in groups.values()) + f" agree among themselves): {why}. "
                          f"Seed every rank alike: torch.manual_seed(s) on each rank {fix}")
