"""Shared-memory transport for the CPU collectives of ranks on one host.

gloo moves a CPU tensor between two processes on one machine through TCP loopback:
the kernel copies it twice and wakes a gloo thread per message. Ranks that share a
host can instead write their tensors into one shared-memory segment and read each
other's. Measured on the 2-core development host (``python benchmarks/bench_collectives.py``):
an all-reduce of 2 MiB over 2 ranks takes gloo 6.0 ms and this transport 1.4 ms, and a 1d
training step issues 21 of them (docs/design.md, "Shared-memory collectives").
DeepSpeed's and vLLM's CPU backends keep a transport of this kind for the same reason.

:mod:`autoshard.runtime.collectives` routes its blocking all-reduce, all-gather and
reduce-scatter of CPU tensors here when :func:`channel` gives one for the group; the
ledger counts them as before. Asynchronous calls (weight prefetch, bucketed gradient
sync) stay on the process group: they overlap compute, which a blocking copy cannot.

A channel is set up on a group's first such collective, by its ranks alone, through
the rendezvous store: group rank 0 creates a file under ``/dev/shm``, every rank maps
it and reports its host and process id, and the channel is used only when every rank
mapped the same file on the same host (otherwise every rank falls back to the process
group, alike); the file is unlinked as soon as all have mapped it, so nothing outlives
the job. ``AUTOSHARD_SHM=0`` turns the transport off.

Layout: a header (per rank: the round it wrote, the round it finished reading, its
pid) and two buffers of one slot per rank. A round writes this rank's slot of buffer
``round % 2``, publishes the round, waits for every rank's, reads the slots, and
publishes that it read them; a rank reuses a buffer only after every rank finished
reading the round before. Every rank sums the slots in rank order, so a sum is
bitwise identical on all of them. Tensors larger than a slot
(``AUTOSHARD_SHM_SLOT_MB``, default 4) go in several rounds. The ordering argument
relies on x86-64's total store order (a flag written after the data is seen after
it), so the transport is used on x86-64 only.

A rank that waits longer than ``AUTOSHARD_TIMEOUT`` for the others, or sees one of
them exit, raises :class:`torch.distributed.DistBackendError` naming the group and
the ranks, as a process-group collective would.
"""

from __future__ import annotations

import os
import platform
import socket
import time
import uuid
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..ir.env import positive_number
from .timeout import timeout_seconds

__all__ = ["channel", "enabled", "Channel", "cpu_backend", "check_cpu_tensor"]

_HEADER = 4096                       # bytes before the buffers: flags and pids (3 × int64 per rank)
_REDUCE_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64}
_CHANNELS: dict[str, tuple[object, "Channel | None"]] = {}    # group name -> (its process group, channel)
_SETUPS: dict[str, int] = {}         # group name -> channels set up for it by this process (store keys)


def enabled() -> bool:
    """Whether the transport may be used: ``AUTOSHARD_SHM`` is not ``0`` and the host is x86-64."""
    return os.environ.get("AUTOSHARD_SHM", "1") != "0" and platform.machine().lower() in ("x86_64", "amd64")


def _slot_bytes() -> int:
    mb = positive_number("AUTOSHARD_SHM_SLOT_MB", 4, what="must be a positive number of megabytes (one rank's "
                         "slot of the shared-memory segment)")
    return max(4096, int(mb * (1 << 20)) // 4096 * 4096)


def channel(group: str, x: torch.Tensor) -> "Channel | None":
    """The shared-memory channel of ``group`` for a blocking collective of ``x``, or None
    (the process group carries it): set up on first use, collectively over the group's
    ranks, which all ask for the same groups in the same order as they run the same
    collectives. None for a tensor off the CPU, a group of one rank, or a group whose
    ranks are not all on this host."""
    if x.device.type != "cpu" or not enabled():
        return None
    pg = c10d._resolve_process_group(group)
    cached = _CHANNELS.get(pg.group_name)         # one channel per group, named by c10d's name or an alias
    if cached is not None and cached[0] is pg:
        return cached[1]
    # only where the group itself carries CPU tensors with gloo: a CPU tensor on an NCCL group
    # is a bug that shared memory would hide on one host until the job spans two
    if cpu_backend(pg) != "gloo":
        _CHANNELS[pg.group_name] = (pg, None)
        return None
    ch = Channel.open(pg, group) if pg.size() > 1 else None
    _CHANNELS[pg.group_name] = (pg, ch)
    return ch


def cpu_backend(pg) -> str | None:
    """The backend that carries ``pg``'s CPU tensors (``"gloo"``), None where none does
    (NCCL alone), from the group's configuration (``"cuda:nccl,cpu:gloo"``)."""
    cached = _CPU_BACKENDS.get(pg.group_name)
    if cached is not None and cached[0] is pg:
        return cached[1]
    from .device import device_backends

    be = device_backends(dist.get_backend_config(pg)).get("cpu")
    _CPU_BACKENDS[pg.group_name] = (pg, be)
    return be


_CPU_BACKENDS: dict = {}    # group name -> (its process group, its CPU backend)


def check_cpu_tensor(group: str, x: torch.Tensor) -> None:
    """Refuse a CPU tensor handed to a collective of a group with no CPU backend (NCCL
    alone): the process group would fail with an unhelpful error, or (through shared
    memory on one host) not at all until the job spans two hosts."""
    if x.device.type != "cpu" or group.startswith("autoshard-sim:"):
        return
    pg = c10d._resolve_process_group(group)
    if cpu_backend(pg) is None:
        from ..ir.errors import CollectiveError

        raise CollectiveError(f"a CPU tensor {tuple(x.shape)} ({x.dtype}) was handed to a collective of group "
                              f"{group!r}, whose backend ({dist.get_backend_config(pg)}) carries no CPU tensors: the "
                              f"module's tensors must be on this rank's GPU (shard(..., device=...) or the device rule "
                              f"of autoshard.runtime.device), or the job must run with a CPU backend (gloo)")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _combine(parts: list[torch.Tensor], dst: torch.Tensor, op: str) -> None:
    """``dst`` := the sum (``op="max"``: the maximum) of ``parts``, the ranks' slots, taken
    in rank order (so it is bitwise the same on every rank)."""
    f = torch.maximum if op == "max" else torch.add
    f(parts[0], parts[1], out=dst)
    for t in parts[2:]:
        f(dst, t, out=dst)


class Channel:
    """One group's shared-memory segment on this host (see the module docstring)."""

    def __init__(self, storage: torch.UntypedStorage, group: str, rank: int, size: int, slot: int,
                 pids: list[int], check_pids: bool):
        self.group, self.rank, self.size, self.slot = group, rank, size, slot
        self._storage = storage                       # keeps the mapping alive
        head = torch.empty(0, dtype=torch.int64, device="cpu").set_(storage, 0, (3, size))
        self._flags = head.numpy()                    # [0]: round written, [1]: round read, [2]: pid
        self._data = torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage, _HEADER, (2, size, slot))
        self._pids = pids
        self._check_pids = check_pids
        self._round = 0
        self._flags[2][rank] = os.getpid()

    # ------------------------------------------------------------------ set-up
    @classmethod
    def open(cls, pg, group: str) -> "Channel | None":
        """Set up ``group``'s channel over the store (every rank of ``pg`` calls this);
        None on every rank unless every rank mapped the segment on this host."""
        store = c10d._get_default_store()
        rank, size = dist.get_rank(pg), pg.size()
        real = pg.group_name                          # ``group`` may be an alias, one name on every rank
        k = _SETUPS.get(real, 0)
        _SETUPS[real] = k + 1
        key = f"autoshard/shm/{real}/{k}"
        slot = _slot_bytes()
        nbytes = _HEADER + 2 * size * slot
        path = None
        if rank == 0:
            path = f"/dev/shm/autoshard-{uuid.uuid4().hex}"
            try:
                with open(path, "wb") as f:
                    f.truncate(nbytes)
            except OSError:
                path = ""
            store.set(f"{key}/path", path)
        else:
            path = store.get(f"{key}/path").decode()
        storage = None
        if path:
            try:
                storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
            except (OSError, RuntimeError):
                storage = None
        store.set(f"{key}/{rank}", f"{int(storage is not None)} {socket.gethostname()} {os.getpid()}")
        reports = [store.get(f"{key}/{r}").decode().split(" ") for r in range(size)]
        if rank == 0 and path:
            os.unlink(path)                           # every rank has mapped it or given up
        if not all(ok == "1" and host == reports[0][1] for ok, host, _ in reports):
            return None
        pids = [int(pid) for _, _, pid in reports]
        return cls(storage, group, rank, size, slot, pids, check_pids=all(_alive(p) for p in pids))

    # ------------------------------------------------------------------ one round
    def _wait(self, row: int, n: int) -> None:
        flags = self._flags[row]
        if flags.min() >= n:
            return
        start = time.monotonic()
        next_check = start + 0.1
        spins = 0
        while flags.min() < n:
            spins += 1
            if spins < 256:
                continue
            if spins < 4096:
                os.sched_yield()
                continue
            now = time.monotonic()
            # a short wait stays short (50 µs naps); a long one (a peer saving a checkpoint)
            # naps longer, up to 1 ms, so that waiting ranks leave the cores to those that work
            time.sleep(min(1e-3, 5e-5 * (1.0 + (now - start) / 0.01)))
            if now < next_check:
                continue
            next_check = now + 0.1
            late = [r for r in range(self.size) if flags[r] < n]
            dead = [r for r in late if self._check_pids and not _alive(self._pids[r])]
            limit = timeout_seconds()
            if dead or now - start > limit:
                why = (f"rank(s) {dead} of the group exited" if dead else
                       f"rank(s) {late} of the group did not arrive within {limit:g} s (AUTOSHARD_TIMEOUT)")
                raise dist.DistBackendError(
                    f"shared-memory collective on group {self.group!r} (this is its rank {self.rank} of "
                    f"{self.size}): {why}")

    def _exchange(self, fill: Callable[[torch.Tensor], None],
                  take: Callable[[list[torch.Tensor]], None]) -> None:
        """One round: ``fill(my slot)`` (uint8), then ``take(every rank's slot)`` once all wrote."""
        n = self._round + 1
        buf = self._data[n & 1]
        self._wait(1, n - 2)                          # every rank finished reading this buffer's last round
        fill(buf[self.rank])
        self._flags[0][self.rank] = n
        self._wait(0, n)
        take([buf[r] for r in range(self.size)])
        self._flags[1][self.rank] = n
        self._round = n

    # ------------------------------------------------------------------ collectives
    def can_reduce(self, dtype: torch.dtype) -> bool:
        return dtype in _REDUCE_DTYPES

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """A new tensor: the sum (``op="max"``: the maximum) of ``x`` over the group."""
        src = x.reshape(-1)
        res = torch.empty(x.shape, dtype=x.dtype, device=x.device)       # not a view (a custom op's output)
        out = res.view(-1)
        per = self.slot // x.element_size()
        for s in range(0, src.numel(), per):
            e = min(src.numel(), s + per)

            def fill(mine, s=s, e=e):
                mine.view(x.dtype)[:e - s].copy_(src[s:e])

            self._exchange(fill, lambda slots, s=s, e=e: _combine([t.view(x.dtype)[:e - s] for t in slots],
                                                                  out[s:e], op))
        return res

    def all_gather(self, out: torch.Tensor, x: torch.Tensor, dim: int) -> None:
        """``out`` (contiguous, ``x``'s shape with ``dim`` ``size`` times longer) := every
        rank's ``x`` concatenated on ``dim`` in rank order. A block that fits a slot goes in
        one round, read straight into its place in ``out``; a larger one in rounds of its
        bytes, through a stack of the blocks when they are not whole rows of ``out``."""
        blocks = out.unflatten(dim, (self.size, x.shape[dim]))
        nbytes = x.numel() * x.element_size()
        if nbytes <= self.slot:
            def fill(mine):
                mine[:nbytes].view(x.dtype).view(x.shape).copy_(x)

            def take(slots):
                for r, t in enumerate(slots):
                    blocks.select(dim, r).copy_(t[:nbytes].view(x.dtype).view(x.shape))
            self._exchange(fill, take)
            return
        whole_rows = all(n == 1 for n in x.shape[:dim])
        stack = out if whole_rows else torch.empty((self.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        src, dst = x.contiguous().view(-1).view(torch.uint8), stack.view(-1).view(torch.uint8)
        for s in range(0, nbytes, self.slot):
            e = min(nbytes, s + self.slot)

            def fill(mine, s=s, e=e):
                mine[:e - s].copy_(src[s:e])

            def take(slots, s=s, e=e):
                for r, t in enumerate(slots):
                    dst[r * nbytes + s:r * nbytes + e].copy_(t[:e - s])
            self._exchange(fill, take)
        if not whole_rows:
            out.copy_(stack.movedim(0, dim).reshape(out.shape))

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, dim: int) -> None:
        """``out`` (contiguous) := the sum over the group of this rank's block of ``x`` on
        ``dim`` (``size`` equal blocks). ``x`` that fits a slot goes in one round, its blocks
        copied straight from their places; a larger one block-major in rounds."""
        p = self.size
        parts = x.unflatten(dim, (p, out.shape[dim])).movedim(dim, 0)       # view: [p, *out.shape]
        dst = out.view(-1)
        m = out.numel()
        if m * p * x.element_size() <= self.slot:
            def fill(mine):
                mine.view(x.dtype)[:p * m].view(parts.shape).copy_(parts)

            self._exchange(fill, lambda slots: _combine(
                [t.view(x.dtype)[self.rank * m:(self.rank + 1) * m] for t in slots], dst, "sum"))
            return
        blocks = parts.reshape(p, m)                  # block-major (a copy unless ``x``'s blocks are rows)
        per = self.slot // (p * x.element_size())
        for s in range(0, m, per):
            e = min(m, s + per)

            def fill(mine, s=s, e=e):
                mine.view(x.dtype)[:p * (e - s)].view(p, e - s).copy_(blocks[:, s:e])

            def take(slots, s=s, e=e):
                k = e - s
                _combine([t.view(x.dtype)[self.rank * k:(self.rank + 1) * k] for t in slots], dst[s:e], "sum")
            self._exchange(fill, take)
