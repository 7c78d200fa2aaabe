"""Gradient all-reduces overlapped with backward, in buckets (DDP-style).

A :class:`~autoshard.module.ShardedModule` all-reduces each replicated parameter's
gradient over its plan's ``grad_sync`` axes (``dp`` and the axes a gradient is partial
on) inside backward. By default (and with ``overlap_grad_sync()``) :class:`BucketedGradSync`
gathers the gradients of
one process group (and dtype) into a bucket and launches the bucket's all-reduce
asynchronously once it holds ``bucket_bytes``: backward goes on computing the next
layers' gradients while the bucket travels; a callback at the end of backward
sends the last partial buckets, waits for all of them and adds each reduced
gradient into ``.grad``.

Exact: the hook hands autograd a zero gradient to accumulate and the callback adds
the reduced one, so ``.grad`` ends as ``previous + all_reduce(incoming)``, as the
per-parameter path leaves it (gradient accumulation included). Fewer calls than
the plan lists (one per bucket, not per parameter): the ledger then counts the
buckets. Every rank must run the same backward (as for any collective): buckets
fill in the same order on every rank.

    sharded.overlap_grad_sync(bucket_bytes=1 << 20)     # on every rank, before training
"""

from __future__ import annotations

import torch

from . import collectives as C
from . import shm


class _Done:
    """The handle of a bucket already reduced (on shared memory)."""

    def wait(self) -> bool:
        return True


_DONE = _Done()

__all__ = ["BucketedGradSync"]


class BucketedGradSync:
    """Hooks on ``params`` (``[(parameter, group name)]``) that all-reduce their
    gradients in asynchronous buckets of about ``bucket_bytes`` during backward. A
    frozen parameter (``requires_grad=False``) has no gradient: it takes no hook and no
    bucket place.

    ``labels`` maps each group name to its mesh axes label (``"row"``, ``"dep,row"``):
    the buckets left at the end of backward are launched in the order of the labels,
    which is the same on every rank. c10d group names are counters that differ by rank
    and sort as strings, so an order by name could launch the all-reduces of different
    communicators in different orders on different ranks, which NCCL may not survive."""

    def __init__(self, params: list, bucket_bytes: int, labels: dict[str, str]):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.bucket_bytes = int(bucket_bytes)
        missing = sorted({g for _, g in params} - set(labels))
        if missing:
            raise ValueError(f"no axes label for process group(s) {missing}")
        self.labels = dict(labels)
        self._pending: dict = {}        # (group, dtype) -> [(param, grad)]
        self._size: dict = {}
        self._inflight: list = []       # (work, flat buffer, [(param, grad)])
        self._queued = False
        self.handles = [p.register_hook(self._hook(p, group)) for p, group in params if p.requires_grad]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, p, group: str):
        def hook(grad):
            if not self._queued:        # once per backward: finish after autograd's last node
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._queued = True
            key = (group, grad.dtype, grad.device)
            self._pending.setdefault(key, []).append((p, grad))
            self._size[key] = self._size.get(key, 0) + grad.numel() * grad.element_size()
            if self._size[key] >= self.bucket_bytes:
                self._launch(key)
            return torch.zeros_like(grad)
        return hook

    def order(self, key) -> tuple:
        """Sort key of a bucket key ``(group, dtype, device)``: the same on every rank."""
        return self.labels[key[0]], str(key[1]), str(key[2])

    def _launch(self, key) -> None:
        bucket = self._pending.pop(key, [])
        self._size.pop(key, None)
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for _, g in bucket])
        if shm.channel(key[0], flat) is not None:
            # CPU ranks of one host: summed through shared memory at once, faster than gloo's
            # loopback and in rank order, as the per-parameter path sums (bitwise the same)
            self._inflight.append((_DONE, C.all_reduce(flat, key[0], "sum"), bucket))
        else:
            self._inflight.append((C.all_reduce_async(flat, key[0]), flat, bucket))

    def _finish(self) -> None:
        for key in sorted(self._pending, key=self.order):      # same order on every rank
            self._launch(key)
        for work, flat, bucket in self._inflight:
            work.wait()
            at = 0
            for p, g in bucket:
                n = g.numel()
                reduced = flat[at:at + n].view_as(g)
                at += n
                if p.grad is None:
                    p.grad = reduced.clone()
                else:
                    p.grad.add_(reduced)
        self._inflight = []
        self._queued = False
