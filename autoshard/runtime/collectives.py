"""Every collective autoshard runs, in one place, counted.

Three raw collectives (all-reduce, all-gather, reduce-scatter) are registered as
``torch.library`` custom ops with shape-only fake kernels, so a rewritten graph
can be re-exported or compiled and sees opaque ops. On top sit the conjugate
pairs tensor parallelism needs; each is differentiable with the backward its
forward implies (never the ``torch.distributed.nn`` one, which would all-reduce
the gradient of an all-reduce and double-count):

=====================  =======================  ========================
op                     forward                  backward
=====================  =======================  ========================
``reduce_from``        all-reduce (sum)         identity
``copy_to``            identity                 all-reduce (sum)
``all_reduce_both``    all-reduce (sum)         all-reduce (sum)
``gather_from``        all-gather on ``dim``    keep the local block
``scatter_to``         keep the local block     all-gather on ``dim``
``reduce_scatter_to``  reduce-scatter on dim    all-gather on ``dim``
``gather_partial``     all-gather on ``dim``    reduce-scatter on ``dim``
=====================  =======================  ========================

Groups are named by the string c10d gives them (``pg.group_name``), or by
:func:`sim_group` (``"autoshard-sim:4"``): a group of that size with this process
as its rank 0 that exists only for shapes, so the kernels run on meta tensors
with no process group (:mod:`autoshard.planning.activations` traces a plan that way). A
:class:`CommLedger` records every call made while it is active::

    with CommLedger() as ledger:
        loss.backward()
    ledger.bytes_per_rank()     # ring model, see docs/design.md, "Communication and memory"
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import shm

__all__ = [
    "CommLedger", "CallRecord", "ring_bytes",
    "reduce_from", "copy_to", "all_reduce_both", "gather_from", "scatter_to",
    "reduce_scatter_to", "gather_partial", "all_reduce_nograd", "all_reduce_max",
    "sim_group", "group_rank_size", "group_rank", "rank_in", "all_reduce", "all_gather", "reduce_scatter", "entry_barrier", "ring_shift",
    "all_gather_two", "reduce_scatter_two", "reduce_scatter_start", "all_gather_start",
    "all_to_all_rows", "count_p2p", "send", "recv",
    "mark_balanced", "is_balanced", "balanced_chunks", "held_chunks", "to_rank_blocks", "from_rank_blocks", "ring_shift_start",
]


def ring_bytes(kind: str, buffer_bytes: int, p: int) -> float:
    """Bytes one rank sends for a collective over ``p`` ranks (ring algorithm).

    ``buffer_bytes`` is the full (gathered / reduced) buffer for all-gather and
    reduce-scatter, the tensor for all-reduce.

    >>> ring_bytes("all_reduce", 1000, 4)
    1500.0
    >>> ring_bytes("all_gather", 1000, 4)
    750.0
    """
    if p <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (p - 1) / p * buffer_bytes
    if kind in ("send_recv", "all_to_all", "send"):     # a ring step; an all-to-all's bytes to the other ranks
        return float(buffer_bytes)
    if kind == "recv":          # a receive sends nothing: its bytes are counted by the sender
        return 0.0
    return (p - 1) / p * buffer_bytes


@dataclass(frozen=True)
class CallRecord:
    kind: str            # all_reduce | all_gather | reduce_scatter | send_recv | all_to_all | send | recv
    group: str           # label of the group (mesh axes, e.g. "dep,row")
    group_size: int
    buffer_bytes: int    # full buffer (see ring_bytes)
    dtype: str = ""      # what travels, e.g. "bfloat16" (bf16 under autocast: docs/design.md, "Mixed precision")
    device: str = ""     # the device type of the tensor handed to the process group

    @property
    def bytes_per_rank(self) -> float:
        return ring_bytes(self.kind, self.buffer_bytes, self.group_size)


_local = threading.local()


def _active() -> list["CommLedger"]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


class CommLedger:
    """Context manager that records every collective call on this rank."""

    def __init__(self) -> None:
        self.calls: list[CallRecord] = []

    def __enter__(self) -> "CommLedger":
        _active().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active().remove(self)

    def bytes_per_rank(self) -> float:
        return sum(c.bytes_per_rank for c in self.calls)

    def count(self) -> int:
        return len(self.calls)

    def __repr__(self) -> str:
        """``CommLedger(3 calls, 1,536 B/rank: all_reduce(tp) ×2 1,024 B, ...)``."""
        kinds = ", ".join(f"{k}({g}) ×{n} {b:,.0f} B" for (k, g), (n, b) in self.by_kind().items())
        return f"CommLedger({self.count()} calls, {self.bytes_per_rank():,.0f} B/rank" + (f": {kinds})" if kinds else ")")

    def by_kind(self) -> dict[tuple[str, str], tuple[int, float]]:
        out: dict[tuple[str, str], tuple[int, float]] = {}
        for c in self.calls:
            n, b = out.get((c.kind, c.group), (0, 0.0))
            out[(c.kind, c.group)] = (n + 1, b + c.bytes_per_rank)
        return out


def _record(kind: str, group: str, buffer_bytes: int, x: torch.Tensor | None = None) -> None:
    stack = _active()
    if not stack:
        return
    pg = c10d._resolve_process_group(group)
    rec = CallRecord(kind, _label(group, pg), pg.size(), int(buffer_bytes),
                     *(() if x is None else (str(x.dtype).removeprefix("torch."), x.device.type)))
    for led in stack:
        led.calls.append(rec)


def _label(group: str, pg) -> str:
    """The mesh axes a call's group is over: the label in an autoshard alias
    (``"autoshard/dp2xtp2/tp"`` -> ``"tp"``; one group may serve several labels, and
    the default group serves the axes that span every rank), else the group's description."""
    if group.startswith("autoshard/"):
        return group.split("/")[2]
    return getattr(pg, "group_desc", group) or group


def process_group(group: str):
    """The torch process group of the named ``group`` (see :func:`_pg`)."""
    return _pg(group)


def _pg(group: str):
    return c10d._resolve_process_group(group)


_SIM = "autoshard-sim:"


def sim_group(size: int, balanced: bool = False) -> str:
    """Name of a shape-only group of ``size`` ranks (this process is its rank 0):
    the fake kernels and :func:`group_rank_size` accept it, a real collective does not;
    ``balanced``: its blocks in the balanced order (:func:`is_balanced`), as the cp group
    of a balanced plan (the trace then runs the kernels as they run)."""
    return f"{_SIM}{int(size)}" + (":balanced" if balanced else "")


@torch.compiler.assume_constant_result      # torch.compile: a constant of the traced graph, no break
def group_rank_size(group: str) -> tuple[int, int]:
    """(this process's rank in ``group``, its size); ``(0, n)`` for :func:`sim_group` names."""
    if group.startswith(_SIM):
        return 0, int(group[len(_SIM):].split(":")[0])
    pg = _pg(group)
    return dist.get_rank(pg), pg.size()


@torch.library.custom_op("autoshard::group_rank", mutates_args=())
def group_rank(like: torch.Tensor, group: str) -> torch.Tensor:
    """This process's rank in ``group``, a 0-d int64 tensor on ``like``'s device. Under
    ``torch.compile`` the kernels' rank-dependent offsets read it instead of the constant
    :func:`group_rank_size` folds into the graph, so that a plan's compiled graph is one
    program on every rank (see docs/design.md, "Compiling once per host")."""
    return torch.full((), group_rank_size(group)[0], dtype=torch.int64, device=like.device)


@group_rank.register_fake
def _(like, group):
    return torch.empty((), dtype=torch.int64, device=like.device)


def rank_in(group: str, like: torch.Tensor):
    """This process's rank in ``group``: an int eagerly, a :func:`group_rank` tensor while
    ``torch.compile`` traces (arithmetic and comparisons take either)."""
    if torch.compiler.is_compiling():
        return group_rank(like, group)
    return group_rank_size(group)[0]


# --------------------------------------------------------------- raw collectives
# Counted by the ledger, no autograd of their own: kernels with a hand-written
# backward (parallel_ops) call these; everything else uses the autograd-aware
# pairs below.
def _all_reduce(x: torch.Tensor, group: str, op: str) -> torch.Tensor:
    """:func:`all_reduce`'s body (the conjugate pairs call it from inside their own op)."""
    _record("all_reduce", group, x.numel() * x.element_size(), x)
    shm.check_cpu_tensor(group, x)
    ch = shm.channel(group, x)
    if ch is not None and ch.can_reduce(x.dtype):
        return ch.all_reduce(x, op)
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=_pg(group))
    return out


@torch.library.custom_op("autoshard::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str, op: str) -> torch.Tensor:
    return _all_reduce(x, group, op)


@all_reduce.register_fake
def _(x, group, op):
    return torch.empty_like(x)


@torch.library.custom_op("autoshard::ring_shift", mutates_args=())
def ring_shift(x: torch.Tensor, group: str) -> torch.Tensor:
    """One step around the ring of ``group``: send ``x`` to the next rank (group rank + 1),
    receive the previous rank's tensor of the same shape (ring attention's K/V blocks,
    :mod:`autoshard.runtime.parallel_ops`). Counted by the ledger as one ``send_recv``
    of ``x``'s bytes."""
    return ring_shift_start(x, group)()


@ring_shift.register_fake
def _(x, group):
    return torch.empty_like(x)


def ring_shift_start(x: torch.Tensor, group: str, tag: int = 0):
    """Launch :func:`ring_shift` of ``x`` (counted now) and return the function that waits
    and gives the received tensor: ring attention computes on the block it holds while
    the next one travels. ``tag`` keeps two shifts in flight on one group apart. Not a
    graph op (a kernel's own forward / backward uses it outside torch.compile)."""
    pg = _pg(group)
    r, p = dist.get_rank(pg), pg.size()
    src = x.contiguous()
    out = torch.empty_like(src)
    _record("send_recv", group, src.numel() * src.element_size(), src)
    shm.check_cpu_tensor(group, src)
    ops = [dist.P2POp(dist.isend, src, dist.get_global_rank(pg, (r + 1) % p), pg, tag),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(pg, (r - 1) % p), pg, tag)]
    works = dist.batch_isend_irecv(ops)

    def finish() -> torch.Tensor:
        for w in works:
            w.wait()
        return out
    return finish


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group: str) -> torch.Tensor:
    """Rows of ``x`` to the ranks of ``group``: the first ``send[0]`` rows to group rank 0,
    the next ``send[1]`` to rank 1, ...; the result holds ``recv[0]`` rows from rank 0, then
    ``recv[1]`` from rank 1, ... (``all_to_all_single`` with uneven splits). Counted by the
    ledger as one ``all_to_all`` of the bytes sent to the other ranks (the rows a rank keeps
    do not travel). Not a graph op: expert parallelism's dispatch and combine
    (:mod:`autoshard.runtime.experts`) call it inside their own autograd functions."""
    pg = _pg(group)
    me = dist.get_rank(pg)
    src = x.contiguous()
    row_bytes = math.prod(src.shape[1:]) * src.element_size()
    _record("all_to_all", group, (sum(send) - send[me]) * row_bytes)
    out = src.new_empty((sum(recv), *src.shape[1:]))
    dist.all_to_all_single(out, src, output_split_sizes=list(recv), input_split_sizes=list(send), group=pg)
    return out


def count_p2p(ops: list, group: str) -> list:
    """Record point-to-point operations (``torch.distributed.P2POp``: ``isend`` / ``irecv``)
    that another engine runs: one ``send`` or ``recv`` call per op, of its tensor's bytes,
    on ``group`` (the name of the process group they run on). Returns ``ops`` unchanged.
    Pipeline parallelism's stages hand torch's schedules their ops through it
    (:mod:`autoshard.training.pipeline`), so the ledger holds what crosses each cut."""
    for op in ops:
        t = op.tensor
        _record("send" if op.op in (dist.isend, dist.send) else "recv", group, t.numel() * t.element_size(), t)
    return ops


def send(x: torch.Tensor, dst: int, group: str) -> None:
    """Send ``x`` to global rank ``dst`` over ``group`` (blocking; counted as a ``send``)."""
    src = x.contiguous()
    _record("send", group, src.numel() * src.element_size(), src)
    dist.send(src, dst=dst, group=_pg(group))


def recv(x: torch.Tensor, src: int, group: str) -> torch.Tensor:
    """Receive into ``x`` from global rank ``src`` over ``group`` (blocking; counted as a
    ``recv``, which sends no bytes). Returns ``x``."""
    _record("recv", group, x.numel() * x.element_size(), x)
    dist.recv(x, src=src, group=_pg(group))
    return x


def all_reduce_async(x: torch.Tensor, group: str):
    """Start a sum all-reduce of ``x`` in place over ``group`` (counted by the ledger)
    and return its work handle (``.wait()``). Not a graph op: the bucketed gradient
    hooks of :mod:`autoshard.runtime.overlap` use it outside autograd."""
    _record("all_reduce", group, x.numel() * x.element_size(), x)
    shm.check_cpu_tensor(group, x)
    return dist.all_reduce(x, op=dist.ReduceOp.SUM, group=_pg(group), async_op=True)


def _launch(kind: str, x: torch.Tensor, dim: int, group: str, async_op: bool):
    """Run (``async_op``: launch) one all-gather / reduce-scatter of ``x`` on ``dim`` over
    ``group``, counted now; return the function that waits and gives the result.

    On the process group the ranks' blocks travel as contiguous runs: a block is whole
    rows of ``x`` when every dim before ``dim`` has size 1 (no copy at all); otherwise the
    gather lands in a ``(p, *x.shape)`` stack copied once into place, and the scatter's
    input is laid out block-major in one copy (both as flat views: gloo checks dim 0 of
    each). Never a transpose of ``dim`` to the front, whose element stride walks the whole
    tensor (a vocab-split logits gather paid two of them). On shared memory
    (:mod:`autoshard.runtime.shm`) the blocks are copied between the slots and their places
    in ``x`` or the result directly."""
    pg = _pg(group)
    p = pg.size()
    dim = dim % x.dim()
    shape = list(x.shape)
    shape[dim] = shape[dim] * p if kind == "all_gather" else shape[dim] // p
    _record(kind, group, (math.prod(shape) if kind == "all_gather" else x.numel()) * x.element_size(), x)
    shm.check_cpu_tensor(group, x)
    ch = None if async_op else shm.channel(group, x)
    if ch is not None and (kind == "all_gather" or ch.can_reduce(x.dtype)):
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        (ch.all_gather if kind == "all_gather" else ch.reduce_scatter)(out, x, dim)
        return lambda: out
    lead = math.prod(shape[:dim])
    if kind == "all_gather":
        src = x.contiguous()
        out = torch.empty(shape if lead == 1 else [p] + list(src.shape), dtype=x.dtype, device=x.device)
        work = dist.all_gather_single(out.view(-1), src.view(-1), group=pg, async_op=async_op)
    else:
        src = x.contiguous() if lead == 1 else \
            x.unflatten(dim, (p, shape[dim])).movedim(dim, 0).contiguous()
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        work = dist.reduce_scatter_single(out.view(-1), src.view(-1), group=pg, async_op=async_op)

    def finish() -> torch.Tensor:
        if work is not None:
            work.wait()
        if kind == "all_gather" and lead != 1:       # a copy, never a view of out (autograd)
            return out.movedim(0, dim).reshape(shape)
        return out
    return finish


def _fake_out(kind: str, x, dim: int, group: str):
    """The shape-only result of an all-gather / reduce-scatter of ``x`` on ``dim`` over ``group``."""
    p = group_rank_size(group)[1]
    shape = list(x.shape)
    shape[dim] = shape[dim] * p if kind == "all_gather" else shape[dim] // p
    return x.new_empty(shape)


def _def_one(kind: str):
    """Register ``autoshard::<kind>``: one blocking ``kind`` collective of ``x`` on ``dim``
    over ``group`` (its fake kernel: the shape only)."""
    def impl(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
        return _launch(kind, x, dim, group, async_op=False)()

    op = torch.library.custom_op(f"autoshard::{kind}", impl, mutates_args=())

    @op.register_fake
    def _(x, dim, group):
        return _fake_out(kind, x, dim, group)
    return op


all_gather = _def_one("all_gather")
reduce_scatter = _def_one("reduce_scatter")


def all_gather_start(x: torch.Tensor, dim: int, group: str):
    """Launch :func:`all_gather` of ``x`` asynchronously (counted now); return the function
    that waits and gives the result. Not a graph op (a weight prefetch: :mod:`autoshard.runtime.parallel_ops`)."""
    return _launch("all_gather", x, dim, group, async_op=True)


def reduce_scatter_start(x: torch.Tensor, dim: int, group: str):
    """Launch :func:`reduce_scatter` of ``x`` asynchronously (counted now); return the
    function that waits and gives the result. Not a graph op: a kernel's backward uses
    it to compute while the scatter travels (:mod:`autoshard.runtime.parallel_ops`)."""
    return _launch("reduce_scatter", x, dim, group, async_op=True)


def _def_two(kind: str, doc: str):
    """Register ``autoshard::<kind>_two``: two ``kind`` collectives on two groups (e.g. a
    SUMMA row and column) in flight together, both launched, then both waited; the
    same two calls and bytes as one after the other."""
    def impl(a: torch.Tensor, a_dim: int, a_group: str, b: torch.Tensor, b_dim: int,
             b_group: str) -> tuple[torch.Tensor, torch.Tensor]:
        # on shared memory one after the other (each is a blocking copy); else both in flight
        if shm.channel(a_group, a) is not None and shm.channel(b_group, b) is not None:
            return (_launch(kind, a, a_dim, a_group, async_op=False)(),
                    _launch(kind, b, b_dim, b_group, async_op=False)())
        fa = _launch(kind, a, a_dim, a_group, async_op=True)
        fb = _launch(kind, b, b_dim, b_group, async_op=True)
        return fa(), fb()

    impl.__doc__ = doc
    op = torch.library.custom_op(f"autoshard::{kind}_two", impl, mutates_args=())

    @op.register_fake
    def _(a, a_dim, a_group, b, b_dim, b_group):
        return _fake_out(kind, a, a_dim, a_group), _fake_out(kind, b, b_dim, b_group)
    return op


all_gather_two = _def_two("all_gather", ":func:`all_gather` of ``a`` and of ``b`` in flight together.")
reduce_scatter_two = _def_two("reduce_scatter", ":func:`reduce_scatter` of ``a`` and of ``b`` in flight together.")


# ------------------------------------------------------ balanced sequence order
# Context parallelism's balanced order (docs/design.md, "Context parallelism"): on a
# group named here, a dim split over the group is cut into 2p chunks and rank r holds
# chunks r and 2p-1-r (one from the front, one from the back), so under a causal mask
# every rank has the same work. The order belongs to the group, so forward and
# backward, every scatter, gather and ring step on it agree; a plan that wants it gets
# its own group over the cp ranks (:func:`autoshard.runtime.groups.plan_groups`).
_BALANCED: set[str] = set()


def mark_balanced(group: str) -> None:
    """Lay the blocks of ``group`` (a c10d group name) out in the balanced order."""
    _BALANCED.add(group)


def is_balanced(group: str) -> bool:
    """Whether ``group``'s blocks are in the balanced order (rank r: chunks r and 2p-1-r)."""
    return group in _BALANCED or (group.startswith(_SIM) and group.endswith(":balanced"))


def balanced_chunks(rank: int, p: int) -> tuple[int, int]:
    """The two chunks (of 2p) rank ``rank`` of ``p`` holds in the balanced order.

    >>> [balanced_chunks(r, 4) for r in range(4)]
    [(0, 7), (1, 6), (2, 5), (3, 4)]
    """
    return rank, 2 * p - 1 - rank


def held_chunks(group: str, rank: int) -> tuple[int, ...]:
    """The chunks of the sequence rank ``rank`` of ``group`` holds, in its local order: its
    block ``(rank,)`` of p, or ``(rank, 2p-1-rank)`` of 2p in the balanced order."""
    p = group_rank_size(group)[1]
    return balanced_chunks(rank, p) if is_balanced(group) else (rank,)


def _chunk_order(p: int) -> list[int]:
    """Rank-block order of the 2p chunks: block r is chunks (r, 2p-1-r)."""
    return [c for r in range(p) for c in balanced_chunks(r, p)]


_ORDERS: dict = {}      # (order, device) -> its index tensor, made once


def _order_index(order: list[int], device: torch.device) -> torch.Tensor:
    """``order`` as an index tensor on ``device``, made once per device: a tensor built
    from a Python list on a GPU is a host-to-device copy, and every collective on a
    balanced group would pay one."""
    key = (tuple(order), device)
    idx = _ORDERS.get(key)
    if idx is None:
        idx = _ORDERS[key] = torch.tensor(order, device=device)
    return idx


def _reorder(x: torch.Tensor, dim: int, order: list[int]) -> torch.Tensor:
    """``x`` with ``dim`` cut into ``len(order)`` chunks, taken in ``order``."""
    n = len(order)
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not hold {n} equal chunks (balanced order)")
    idx = _order_index(order, x.device)
    return x.unflatten(dim, (n, x.shape[dim] // n)).index_select(dim, idx).flatten(dim, dim + 1)


def to_rank_blocks(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """A whole ``dim`` in the order the ranks' blocks concatenate to (identity unless balanced)."""
    if group not in _BALANCED:
        return x
    return _reorder(x, dim, _chunk_order(_pg(group).size()))


def from_rank_blocks(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """The ranks' blocks concatenated on ``dim`` back in the sequence's own order."""
    if group not in _BALANCED:
        return x
    order = _chunk_order(_pg(group).size())
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return _reorder(x, dim, inverse)


def local_block(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """This rank's block of a whole ``dim`` (no communication, outside autograd)."""
    pg = _pg(group)
    p, balanced = pg.size(), group in _BALANCED
    n = 2 * p if balanced else p                  # the chunks of ``dim``; the rank holds one, or two balanced
    if torch.compiler.is_compiling() and x.shape[dim] % n == 0:
        # picked by the rank as a graph value, so the traced graph is one program on every rank
        r = group_rank(x, group).view(1)
        idx = torch.cat([r, 2 * p - 1 - r]) if balanced else r
        return x.unflatten(dim, (n, x.shape[dim] // n)).index_select(dim, idx).flatten(dim, dim + 1)
    if balanced:
        parts = x.chunk(2 * p, dim=dim)
        a, b = balanced_chunks(dist.get_rank(pg), p)
        return torch.cat([parts[a], parts[b]], dim)
    return x.chunk(p, dim=dim)[dist.get_rank(pg)].clone(memory_format=torch.contiguous_format)


# ------------------------------------------------------ differentiable conjugates
def _def_pair(name, fwd, bwd, *, has_dim: bool):
    """Register ``autoshard::<name>`` whose forward is ``fwd`` and backward ``bwd``."""
    if has_dim:
        def impl(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
            return fwd(x, dim, group)
    else:
        def impl(x: torch.Tensor, group: str) -> torch.Tensor:  # type: ignore[misc]
            return fwd(x, None, group)
    op = torch.library.custom_op(f"autoshard::{name}", impl, mutates_args=())

    if has_dim:
        @op.register_fake
        def _(x, dim, group):
            return _fake_like(name, x, dim, group)
    else:
        @op.register_fake
        def _(x, group):
            return torch.empty_like(x)

    def setup(ctx, inputs, output):
        ctx.args = inputs[1:]

    # an identity backward hands the gradient on as it is: only an op's forward output
    # may not alias its input (reduce_from's backward cloned 2 MiB per call for nothing)
    back = (lambda g, dim, group: g) if bwd is _identity else bwd

    def backward(ctx, grad):
        if has_dim:
            dim, group = ctx.args
            return back(grad, dim, group), None, None
        (group,) = ctx.args
        return back(grad, None, group), None

    op.register_autograd(backward, setup_context=setup)
    return op


def _fake_like(name, x, dim, group):
    return _fake_out("all_gather" if name in ("gather_from", "gather_partial") else "reduce_scatter", x, dim, group)


def _identity(x, dim, group):
    return x.clone()


def _ar(x, dim, group):
    return all_reduce(x, group, "sum")


def _ag(x, dim, group):
    return from_rank_blocks(all_gather(x, dim, group), dim, group)


def _rs(x, dim, group):
    return reduce_scatter(to_rank_blocks(x, dim, group), dim, group)


# A pair's forward runs inside its own op, on real tensors only: it calls the raw
# collectives' bodies (one dispatch per call). Its backward is traced under
# torch.compile, so it calls the ops above, whose fake kernels the trace sees.
def _ar_body(x, dim, group):
    return _all_reduce(x, group, "sum")


def _ag_body(x, dim, group):
    return from_rank_blocks(_launch("all_gather", x, dim, group, async_op=False)(), dim, group)


def _rs_body(x, dim, group):
    return _launch("reduce_scatter", to_rank_blocks(x, dim, group), dim, group, async_op=False)()


def _keep(x, dim, group):
    return local_block(x, dim, group)


_reduce_from = _def_pair("reduce_from", _ar_body, _identity, has_dim=False)
_copy_to = _def_pair("copy_to", _identity, _ar, has_dim=False)
_all_reduce_both = _def_pair("all_reduce_both", _ar_body, _ar, has_dim=False)
_gather_from = _def_pair("gather_from", _ag_body, _keep, has_dim=True)
_scatter_to = _def_pair("scatter_to", _keep, _ag, has_dim=True)
_reduce_scatter_to = _def_pair("reduce_scatter_to", _rs_body, _ag, has_dim=True)
_gather_partial = _def_pair("gather_partial", _ag_body, _rs, has_dim=True)


def reduce_from(x, group: str):
    """Sum partial values over ``group``; gradient passes through (it is already complete)."""
    return _reduce_from(x, group)


def copy_to(x, group: str):
    """Use a replicated value with data split over ``group``: forward identity, backward sum."""
    return _copy_to(x, group)


def all_reduce_both(x, group: str):
    return _all_reduce_both(x, group)


def gather_from(x, dim: int, group: str):
    return _gather_from(x, dim, group)


def scatter_to(x, dim: int, group: str):
    return _scatter_to(x, dim, group)


def reduce_scatter_to(x, dim: int, group: str):
    return _reduce_scatter_to(x, dim, group)


def gather_partial(x, dim: int, group: str):
    return _gather_partial(x, dim, group)


def all_reduce_nograd(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum over ``group`` outside autograd (token counts, statistics)."""
    return all_reduce(x.detach(), group, "sum")


def all_reduce_max(x: torch.Tensor, group: str) -> torch.Tensor:
    return all_reduce(x.detach(), group, "max")


# ------------------------------------------------------------------ entry barrier

_ENTRIES: dict[str, int] = {}      # call name -> how many times this rank entered it


def entry_barrier(call: str, timeout: float | None = None) -> None:
    """Check that every rank entered the collective ``call`` before its first real collective.

    Each rank sets ``autoshard/<call>/<n>/<rank>`` in the rendezvous store (``n``
    counts this rank's entries into ``call``) and waits up to ``timeout`` seconds
    (``AUTOSHARD_ENTRY_TIMEOUT``, default 20) for the other ranks' keys: a call made
    on one rank only raises :class:`~autoshard.ir.errors.CollectiveError` naming the call
    and the ranks that did not arrive, instead of hanging in a gather for the
    collective timeout. Store reads only: no process-group collective, so it cannot
    itself hang. A no-op without a process group or on one rank.

        entry_barrier("save_pretrained")
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from ..ir.errors import CollectiveError

    rank, world = dist.get_rank(), dist.get_world_size()
    n = _ENTRIES.get(call, 0)
    _ENTRIES[call] = n + 1
    if timeout is None:
        timeout = float(os.environ.get("AUTOSHARD_ENTRY_TIMEOUT", "20"))
    store = c10d._get_default_store()
    prefix = f"autoshard/{call}/{n}/"
    store.set(f"{prefix}{rank}", "1")
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        missing = [r for r in range(world) if r != rank and not store.check([f"{prefix}{r}"])]
        if not missing:
            return
        if time.monotonic() >= deadline:
            # take this entry back, so that the next call of ``call`` on every rank meets at
            # the same count again (a misuse must not leave the ranks' counts out of step)
            _ENTRIES[call] = n
            store.delete_key(f"{prefix}{rank}")
            raise CollectiveError(
                f"{call} is collective and must be called on every rank: rank(s) {missing} of {world} did not "
                f"enter it within {timeout:g} s (this is rank {rank}, call #{n + 1}); "
                f"set AUTOSHARD_ENTRY_TIMEOUT to wait longer")
        time.sleep(pause)
        pause = min(pause * 2, 0.1)
