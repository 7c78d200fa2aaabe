"""Expert parallelism's dropless dispatch and combine (docs/design.md, "Expert parallelism").

A mixture-of-experts layer hands its grouped matmuls the routed token rows sorted by
expert, with the group offsets ``offs`` (``offs[e]``: the rows of experts ``0..e``).
Under expert parallelism the ``E`` experts are cut into ``p`` contiguous blocks of
``L = ceil(E / p)`` (zero-padded experts that get no row complete the last ones where ``p``
does not divide ``E``), one per rank of the ep group, so the rows a rank sends to group rank
``j`` are one contiguous run of its sorted rows (experts ``jL .. jL+L-1``):

1. :func:`ep_route`: the per-expert counts go to the expert owners (one
   ``all_to_all`` of ``L`` integers per pair of ranks); each rank learns how many rows
   every source sends it for each of its experts.
2. :func:`ep_dispatch`: the rows travel (``all_to_all_single`` with uneven splits) and
   are reordered from source-major to expert-major, so the local experts' grouped
   matmuls see each expert's rows together (:func:`ep_local_offs`).
3. :func:`ep_combine`: the results go back the reverse way, in the sender's order;
   the model's own weighting, un-permuting and top-k sum follow, unchanged.

No capacity factor, no dropped row. Both row movements are autograd functions whose
backward is the reverse all-to-all, so the gradients are exact; every collective goes
through :mod:`autoshard.runtime.collectives` (the ledger counts it).

Example (one rank holds all experts: the route is the identity)::

    route = ep_route(offs, group)          # counts exchanged
    xr = ep_dispatch(x, route)             # rows at their experts' rank
    y = grouped_linear(xr, w_local, ep_local_offs(route), ...)
    out = ep_combine(y, route)             # back in x's order
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import collectives as C

__all__ = ["Route", "ep_route", "ep_dispatch", "ep_combine", "ep_local_offs", "ep_expert_rows"]


@dataclass(frozen=True, eq=False)
class Route:
    """Where one rank's sorted rows go and where its received rows come from.

    ``send[j]``: rows to group rank ``j``; ``recv[j]``: rows from it; ``perm``: the
    received (source-major) row of each row in expert-major order; ``local_offs``: the
    group offsets of the local experts over the expert-major rows."""

    group: str
    send: tuple[int, ...]
    recv: tuple[int, ...]
    perm: torch.Tensor
    local_offs: torch.Tensor


def _counts(offs: torch.Tensor) -> torch.Tensor:
    """Per-expert row counts (int64) from cumulative offsets (integers or floats)."""
    o = offs.detach().to(torch.float64).round().to(torch.int64)
    return torch.diff(o, prepend=o.new_zeros(1))


def ep_route(offs: torch.Tensor, group: str) -> Route:
    """Exchange the per-expert row counts over the ep ``group`` (one all-to-all).

    ``offs`` are this rank's group offsets over all ``E`` experts; the group's ``p``
    ranks own ``ceil(E / p)`` experts each, in order, the last ones zero-padded experts
    where ``p`` does not divide ``E`` (the router never picks them: they get no row)."""
    me, p = C.group_rank_size(group)
    counts = _counts(offs)
    e = counts.numel()
    local = -(-e // p)
    if e < local * p:       # experts zero-padded to p blocks of ceil(E / p) (passes.experts): no row picks a padded one
        counts = torch.cat([counts, counts.new_zeros(local * p - e)])
    mine = counts.view(p, local)                       # [destination, its local expert]
    got = C.all_to_all_rows(mine, [1] * p, [1] * p, group) if p > 1 else mine   # [source, my local expert]
    send = tuple(int(v) for v in mine.sum(1).tolist())
    recv = tuple(int(v) for v in got.sum(1).tolist())
    # received blocks (source s, expert l) in source-major order; taken expert-major
    sizes = got.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    sizes_t, starts_t = got.t().reshape(-1), starts.view(p, local).t().reshape(-1)
    total = int(sizes.sum())
    base = torch.repeat_interleave(starts_t, sizes_t)
    within = torch.arange(total, dtype=torch.int64, device=sizes.device) - torch.repeat_interleave(torch.cumsum(sizes_t, 0) - sizes_t,
                                                                             sizes_t)
    perm = (base + within).to(offs.device)
    local_offs = torch.cumsum(got.sum(0), 0).to(device=offs.device, dtype=offs.dtype)
    return Route(group=group, send=send, recv=recv, perm=perm, local_offs=local_offs)


def ep_local_offs(route: Route) -> torch.Tensor:
    """The group offsets of this rank's local experts over the rows :func:`ep_dispatch` gives."""
    return route.local_offs


class _Exchange(torch.autograd.Function):
    """Rows ``send`` out, ``recv`` in over ``group``; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.args = (send, recv, group)
        if C.group_rank_size(group)[1] == 1:
            return x.clone()
        return C.all_to_all_rows(x, list(send), list(recv), group)

    @staticmethod
    def backward(ctx, g):
        send, recv, group = ctx.args
        if C.group_rank_size(group)[1] == 1:
            return g, None, None, None
        return C.all_to_all_rows(g, list(recv), list(send), group), None, None, None


def ep_dispatch(x: torch.Tensor, route: Route) -> torch.Tensor:
    """``x``'s rows (sorted by expert, as the offsets count them) at the ranks owning
    their experts, in expert-major order there. Differentiable (backward: the rows'
    gradients go back to their senders)."""
    got = _Exchange.apply(x, route.send, route.recv, route.group)
    return got.index_select(0, route.perm)


def ep_combine(y: torch.Tensor, route: Route) -> torch.Tensor:
    """The experts' results ``y`` (rows as :func:`ep_dispatch` gave them) back at their
    senders, in the order of the rows sent. Differentiable."""
    back = torch.empty_like(route.perm).index_copy_(0, route.perm, torch.arange(route.perm.numel(),
                                                                                device=route.perm.device))
    return _Exchange.apply(y.index_select(0, back), route.recv, route.send, route.group)


def ep_expert_rows(w: torch.Tensor, route: Route) -> torch.Tensor:
    """Each received row's row of ``w`` (this rank's block of a per-expert parameter, ``[L, ...]``):
    the rows :func:`ep_dispatch` gives are expert-major, local expert ``l`` holding
    ``local_offs[l] - local_offs[l-1]`` of them, so ``w[l]`` repeated that many times. What
    ``w_whole[ids]`` gathered on the sender, without moving it. Differentiable in ``w``.

    >>> r = Route(group="", send=(), recv=(), perm=torch.arange(3), local_offs=torch.tensor([1, 3]))
    >>> ep_expert_rows(torch.tensor([[1.], [2.]]), r).flatten().tolist()
    [1.0, 2.0, 2.0]
    """
    o = route.local_offs.detach().to(torch.float64).round().to(torch.int64)
    counts = torch.diff(o, prepend=o.new_zeros(1)).to(w.device)
    return w.index_select(0, torch.repeat_interleave(torch.arange(counts.numel(), device=w.device), counts))
