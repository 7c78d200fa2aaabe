"""Live profiler: measure a :class:`~autoshard.planning.cost.Cluster` on the current process group.

The cost model (:mod:`autoshard.planning.cost`) is pure: it reads a plan and a Cluster.
This module is the one place that runs collectives to fill a Cluster in: every rank
calls :func:`profile` at once, each measurement below times one thing (bandwidth,
per-call cost, pair overlap, matmul rate, dispatch cost), and the figures are agreed
over ranks so that every rank returns the same Cluster.

Example (under ``torchrun --nproc-per-node 2``)::

    cluster = autoshard.profile()
    sharded = autoshard.shard(model, mode="auto", cluster=cluster)
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .cost import Cluster
from ..ir.errors import ConfigError
from ..runtime import collectives as C
from ..runtime.device import uses_cuda

__all__ = ["profile"]


@dataclass(frozen=True)
class _Probe:
    """What every measurement shares: this rank's place, its device, and the small
    matmul (``busy``) each timed collective follows."""

    world: int
    rank: int
    rpn: int
    cuda: bool
    device: torch.device
    weight: torch.Tensor
    busy_s: float = 0.0

    def sync(self) -> None:
        """Wait for the device's queued work (nothing to wait for on a CPU)."""
        if self.cuda:
            torch.cuda.synchronize()

    def busy(self) -> None:
        """The computation each timed collective follows (a layer's matmul, small)."""
        self.weight @ self.weight


@dataclass(frozen=True)
class _Measured:
    """One rank's figures, before the ranks agree on them (:func:`_agree`)."""

    intra: tuple[float, float]
    inter: tuple[float, float]
    flops: float
    curve: list
    memory_bytes: int
    call: float
    op: float
    overlap: float


def _fit_alpha_beta(samples: list[tuple[int, float, float]]) -> tuple[float, float]:
    """Least squares of ``t = steps·α + bytes/β`` over (steps, bytes, seconds); returns (α, β)."""
    s_ss = sum(s * s for s, _, _ in samples)
    s_sb = sum(s * b for s, b, _ in samples)
    s_bb = sum(b * b for _, b, _ in samples)
    s_st = sum(s * t for s, _, t in samples)
    s_bt = sum(b * t for _, b, t in samples)
    det = s_ss * s_bb - s_sb * s_sb
    if det <= 0:
        inv_beta = max(s_bt / s_bb, 1e-15) if s_bb else 1e-15
        return 0.0, 1.0 / inv_beta
    alpha = (s_st * s_bb - s_bt * s_sb) / det
    inv_beta = (s_ss * s_bt - s_sb * s_st) / det
    if alpha < 0 or inv_beta <= 0:          # noisy timings: fall back to one-parameter fits
        inv_beta = max(s_bt / s_bb, 1e-15)
        alpha = max(0.0, min((t - b * inv_beta) / s for s, b, t in samples))
    return max(alpha, 0.0), 1.0 / inv_beta


def _fit_call_cost(tiny_t: list[tuple[int, float]], intra_samples: list[tuple[int, float, float]],
                   intra: tuple[float, float]) -> tuple[float, tuple[float, float]]:
    """(per-call seconds, refitted intra-node (α, β)) from tiny all-reduces' (ring steps,
    seconds), fitted as ``t = call + steps·α``; β is then read off the largest messages
    of ``intra_samples`` once the fixed costs are known (median over them)."""
    if len(tiny_t) >= 2:
        n = len(tiny_t)
        mx = sum(x for x, _ in tiny_t) / n
        my = sum(y for _, y in tiny_t) / n
        sxx = sum((x - mx) ** 2 for x, _ in tiny_t)
        a = max(sum((x - mx) * (y - my) for x, y in tiny_t) / sxx, 0.0) if sxx else 0.0
        call = max(my - a * mx, 0.0)
        big = max((b for _, b, _ in intra_samples), default=0)
        rates = sorted(b / (t - call - s * a) for s, b, t in intra_samples
                       if b == big and t - call - s * a > 0)
        return call, (a, rates[len(rates) // 2] if rates else intra[1])
    if tiny_t:
        return max(tiny_t[0][1] - tiny_t[0][0] * intra[0], 0.0), intra
    return 0.0, intra


# --------------------------------------------------------------------------- timing

def _timed_loop(fn, iters: int, sync) -> float:
    """Seconds per call of ``fn`` run ``iters`` times, every rank at once (a fixed count:
    ``fn`` may be a collective), between barriers."""
    fn()
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def _between(fn, probe: _Probe, iters: int) -> float:
    """Seconds ``fn`` (a collective) costs as a rewritten graph pays it: each call after a
    small computation (``probe.busy``, whose own ``busy_s`` is taken off), so that the group's
    ranks reach it at their own pace, as they do out of a layer's matmuls. On a host
    whose cores the ranks share, a call timed back to back would catch its partners
    already waiting and read a fraction of that."""
    return max(_timed_loop(lambda: (probe.busy(), fn()), iters, probe.sync) - probe.busy_s, 0.0)


def _per_call(fn, probe: _Probe, window: float = 0.05) -> float:
    """Seconds per call of ``fn``, every rank looping at once for ``window`` seconds:
    ranks that share cores measure their share, as they get it while a layout runs
    (a short loop would catch a core to itself between the others' time slices)."""
    dist.barrier()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        if n % 4 == 0:
            probe.sync()
            dt = time.perf_counter() - t0
            if dt >= window:
                return dt / n


# --------------------------------------------------------------------------- measurements

def _probe(ranks_per_node: int | None, iters: int) -> _Probe:
    """This rank's :class:`_Probe`, with the busy matmul's own time measured; a
    ConfigError without a process group or with ranks per node that do not divide the world."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("autoshard.profile needs an initialised process group (run under torchrun)")
    world, rank = dist.get_world_size(), dist.get_rank()
    rpn = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if rpn < 1 or world % rpn:
        raise ConfigError(f"ranks_per_node={rpn} must divide the world size {world}")
    cuda = uses_cuda()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    probe = _Probe(world=world, rank=rank, rpn=rpn, cuda=cuda, device=device,
                   weight=torch.randn(256, 256, device=device))
    return dataclasses.replace(probe, busy_s=_timed_loop(probe.busy, max(iters, 10), probe.sync))


def _time_collectives(group, p: int, probe: _Probe, sizes, iters: int) -> list[tuple[int, float, float]]:
    """(ring steps, bytes sent, seconds) of an all-reduce and an all-gather of each of
    ``sizes`` bytes over ``group`` (:func:`_between`), through
    :mod:`autoshard.runtime.collectives` as a step runs them (shared memory between CPU
    ranks of one host)."""
    out = []
    name = group.group_name
    for nbytes in sizes:
        numel = max(p, nbytes // 4 // p * p)
        x = torch.ones(numel, dtype=torch.float32, device=probe.device)
        for kind in ("all_reduce", "all_gather"):
            def once():
                if kind == "all_reduce":
                    C.all_reduce(x, name, "sum")
                else:
                    C.all_gather(x[: numel // p], 0, name)
            dt = _between(once, probe, iters)
            steps = 2 * (p - 1) if kind == "all_reduce" else p - 1
            sent = (2 if kind == "all_reduce" else 1) * (p - 1) / p * numel * 4
            out.append((steps, sent, dt))
    return out


def _measure_bandwidth(probe: _Probe, sizes, iters: int):
    """(intra-node samples, intra (α, β), inter (α, β) or None where the job has one node):
    collectives of ``sizes`` bytes inside each node and between the ranks of one local
    index on different nodes, all such groups at once, as tensor-parallel traffic runs."""
    world, rpn, rank = probe.world, probe.rpn, probe.rank
    # groups are created by every rank in the same order
    node_groups = [dist.new_group(list(range(n * rpn, (n + 1) * rpn))) for n in range(world // rpn)]
    slot_groups = [dist.new_group(list(range(s, world, rpn))) for s in range(rpn)] if world > rpn else []
    intra = inter = None
    intra_samples: list = []
    if rpn > 1:
        intra_samples = _time_collectives(node_groups[rank // rpn], rpn, probe, sizes, iters)
        intra = _fit_alpha_beta(intra_samples)
    if slot_groups:
        a, b = _fit_alpha_beta(_time_collectives(slot_groups[rank % rpn], world // rpn, probe, sizes, iters))
        inter = (a, b * rpn)       # all rpn slots ran at once: the node's links carried rpn flows
    if intra is None:
        intra = inter if inter is not None else (0.0, 1e12)
    return intra_samples, intra, inter


def _measure_matmul_rate(probe: _Probe, matmul_size: int | None) -> tuple[float, list]:
    """(FLOP/s at ``matmul_size``, [(edge, FLOP/s), ...] over the curve's sizes up to it)."""
    dtype = torch.bfloat16 if probe.cuda else torch.float32

    def rate_at(n: int) -> float:
        a = torch.randn(n, n, device=probe.device, dtype=dtype)
        b = torch.randn(n, n, device=probe.device, dtype=dtype)
        a @ b
        probe.sync()
        return 2 * n ** 3 / _per_call(lambda: a @ b, probe)

    n = matmul_size or (4096 if probe.cuda else 512)
    flops = rate_at(n)
    edges = (1024, 2048, 4096, 8192) if probe.cuda else (32, 64, 128, 256, 512)
    return flops, [(e, flops if e == n else rate_at(e)) for e in edges if not matmul_size or e <= n]


def _measure_op_overhead(probe: _Probe) -> float:
    """Seconds one graph node costs per step: forward + backward of a chain of small
    elementwise ops (dispatch, autograd), per op."""
    x = torch.randn(64, 64, device=probe.device, requires_grad=True)

    def chain(k: int = 50) -> None:
        y = x
        for _ in range(k):
            y = y * 1.0001
        y.sum().backward()

    chain()
    return _per_call(chain, probe) / 52


def _measure_call_cost(probe: _Probe, iters: int) -> list[tuple[int, float]]:
    """(ring steps, seconds) of tiny all-reduces on groups of 2, 4, ... ranks of a node
    (every group at once), through autoshard's own collective op as the rewritten graph
    calls it (:func:`_fit_call_cost` reads the per-call cost off them)."""
    world, rpn, rank = probe.world, probe.rpn, probe.rank
    sizes_p = sorted({g for g in (2, 4, 8, 16, 32, rpn) if 2 <= g <= rpn and rpn % g == 0})
    tiny = torch.ones(16, device=probe.device)
    out = []
    for g in sizes_p:
        groups = [dist.new_group(list(range(i, i + g))) for i in range(0, world, g)]
        mine = groups[rank // g].group_name
        out.append((2 * (g - 1), _between(lambda: C.all_reduce(tiny, mine, "sum"), probe, max(iters, 10))))
    return out


def _measure_pair_overlap(probe: _Probe, iters: int) -> float:
    """:attr:`Cluster.pair_overlap` measured: two all-gathers on two different groups of
    2 ranks of a node (rows and columns of 2 × 2 blocks, every block at once) sent one
    at a time, then together (:func:`autoshard.runtime.collectives.all_gather_two`); the share of
    the shorter that the pair hid. Where the node has no 2 × 2 block: 1 on a GPU (streams
    of their own), 0 on a CPU (shared cores)."""
    world, rpn, rank = probe.world, probe.rpn, probe.rank
    if rpn % 4 or world % 4:
        return 1.0 if probe.cuda else 0.0
    rows = [dist.new_group([i, i + 1]) for i in range(0, world, 2)]
    cols = [dist.new_group([b + j, b + j + 2]) for b in range(0, world, 4) for j in (0, 1)]
    row = rows[rank // 2].group_name
    col = cols[(rank // 4) * 2 + rank % 2].group_name
    a = torch.ones(1 << 14, device=probe.device)
    b = torch.ones(1 << 14, device=probe.device)
    t_a = _between(lambda: C.all_gather(a, 0, row), probe, iters)
    t_b = _between(lambda: C.all_gather(b, 0, col), probe, iters)
    t_two = _between(lambda: C.all_gather_two(a, 0, row, b, 0, col), probe, iters)
    short = min(t_a, t_b)
    return min(max((t_a + t_b - t_two) / short, 0.0), 1.0) if short > 0 else 1.0


def _memory_per_rank(probe: _Probe) -> int:
    """Bytes of one rank's memory: the GPU's, or the host's shared by the node's ranks."""
    if probe.cuda:
        return torch.cuda.get_device_properties(probe.device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // probe.rpn


def _agree(probe: _Probe, m: _Measured) -> Cluster:
    """The Cluster every rank returns: slowest latency, bandwidth and flops, smallest
    memory and overlap over ranks (one all-reduce), so ``mode="auto"`` picks the same
    plan everywhere."""
    vals = torch.tensor([m.intra[0], -m.intra[1], m.inter[0], -m.inter[1], -m.flops, -float(m.memory_bytes),
                         m.call, m.op, -m.overlap] + [-r for _, r in m.curve], dtype=torch.float64,
                        device=probe.device)       # NCCL reduces device tensors only
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    v = vals.tolist()
    return Cluster(name="measured", ranks_per_node=probe.rpn, intra_latency=v[0], intra_bw=-v[1],
                   inter_latency=v[2], inter_bw=-v[3], flops=-v[4], memory_bytes=int(-v[5]),
                   device="cuda" if probe.cuda else "cpu", call_overhead=v[6], op_overhead=v[7],
                   pair_overlap=-v[8], flops_curve=tuple((e, -r) for (e, _), r in zip(m.curve, v[9:])))


def profile(*, sizes: tuple[int, ...] = (1 << 12, 1 << 18, 1 << 22), iters: int = 5,
            ranks_per_node: int | None = None, matmul_size: int | None = None,
            memory_bytes: int | None = None) -> Cluster:
    """Measure a :class:`Cluster` on the current process group (call on every rank).

    Times all-reduces and all-gathers of ``sizes`` bytes inside each node (and, if
    the job spans nodes, between ranks of the same local index on different nodes,
    all such groups at once, as tensor-parallel traffic would run) and one matmul;
    fits ``t = steps·α + bytes/β`` per link class. Every collective is timed as a
    rewritten graph pays it, after a small matmul (whose own time is taken off): the
    per-call cost of tiny all-reduces on groups of 2, 4, ... ranks, the bytes, and
    how much of a pair sent together (:attr:`Cluster.pair_overlap`) overlaps. The
    figures are maxed over ranks, so every rank returns the same Cluster (and
    ``mode="auto"`` picks the same plan everywhere). With one node the inter-node
    figures copy the intra-node ones.

    Args:
        sizes: message sizes in bytes the bandwidth fit times.
        iters: timed calls per message size.
        ranks_per_node: ranks that share a node (default ``LOCAL_WORLD_SIZE``, else the world).
        matmul_size: edge of the matmul that sets ``flops`` (default 4096 on a GPU, 512 on a CPU).
        memory_bytes: memory of one rank (default: measured).

    Returns:
        The measured Cluster, the same on every rank.

    Raises:
        ConfigError: no initialised process group, or ``ranks_per_node`` does not divide the world.

    Example (under ``torchrun --nproc-per-node 2``)::

        cluster = autoshard.profile()
        sharded = autoshard.shard(model, mode="auto", cluster=cluster)
    """
    probe = _probe(ranks_per_node, iters)
    intra_samples, intra, inter = _measure_bandwidth(probe, sizes, iters)
    flops, curve = _measure_matmul_rate(probe, matmul_size)
    op = _measure_op_overhead(probe)
    call, intra = _fit_call_cost(_measure_call_cost(probe, iters), intra_samples, intra)
    if inter is None:           # one node: the inter-node figures copy the intra-node ones
        inter = intra
    overlap = _measure_pair_overlap(probe, max(iters, 10))
    if memory_bytes is None:
        memory_bytes = _memory_per_rank(probe)
    return _agree(probe, _Measured(intra=intra, inter=inter, flops=flops, curve=curve, memory_bytes=memory_bytes,
                                   call=call, op=op, overlap=overlap))
