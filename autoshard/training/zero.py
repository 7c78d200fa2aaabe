"""Optimizer state sharded over the data-parallel replicas (ZeRO-1 / ZeRO-2).

With ``dp`` replicas every one of them holds the same tensor-parallel shard of
each parameter, and a plain optimizer keeps the same AdamW moments ``dp`` times.
:class:`ZeroAdamW` gives each replica ``1/dp`` of them: every local parameter
(this rank's TP block, flattened) is cut into ``dp`` equal chunks and replica
``i`` keeps and updates chunk ``i`` only; after the update one all-gather over
``dp`` gives every replica the whole parameter again (Rajbhandari et al., ZeRO,
stage 1). With ``stage=2`` the gradients are sharded too: the data-parallel part
of the gradient all-reduce becomes a reduce-scatter (each micro-batch's
gradient, as soon as autograd has accumulated it), and a replica keeps only its
chunk of it (the TP part of the gradient sync, if any, stays an all-reduce).

It composes with every TP mode (it works on the local shards, whatever their
spec). Global-norm clipping (:meth:`ZeroAdamW.clip_grad_norm_`) counts each
dense entry once. A checkpoint stores the whole TP-local state
(:meth:`ZeroAdamW.gathered`, a plain ``AdamW`` equal to what an unsharded one
would hold), so it can be resumed on another ``dp``, with or without ZeRO::

    opt, sched = autoshard.training.train.make_optimizer(sharded, lr=3e-4, steps=100, zero=2)
    autoshard.training.train.train(sharded, batches, steps=100, optimizer=opt, scheduler=sched, clip=1.0)

Collectives go through :mod:`autoshard.runtime.collectives` (counted by the ledger).
"""

from __future__ import annotations

import math

import torch

from ..ir.plan import GRAD_BUCKET_BYTES
from ..runtime import collectives as C

__all__ = ["ZeroAdamW", "optimizer_state_bytes"]


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of tensor state this rank's ``optimizer`` holds (AdamW: both moments and the step)."""
    return sum(_local(v).numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (PyTorch's own TP keeps its optimizer state as DTensors)."""
    return t.to_local() if hasattr(t, "to_local") else t


class ZeroAdamW(torch.optim.AdamW):
    """AdamW over this replica's ``1/dp`` chunk of every local parameter.

    ``sharded``: a :class:`~autoshard.module.ShardedModule` (``mesh.dp`` replicas;
    with ``dp = 1`` it is a plain AdamW over the local shards). ``stage``: 1 (the
    optimizer state is sharded) or 2 (the gradients too). The other arguments are
    :class:`torch.optim.AdamW`'s. Build it on every rank, in the same order
    relative to other collectives (it may create the ``dp`` process group).
    """

    def __init__(self, sharded, *, stage: int = 1, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        from ..ir.errors import ConfigError
        from ..io.gather import unique_params

        if stage not in (1, 2):
            raise ConfigError(f"ZeRO stage {stage!r}: the valid choices are 1 (optimizer state sharded over dp) "
                              f"and 2 (gradients too)")
        self.sharded, self.stage = sharded, stage
        mesh = sharded.mesh
        self.dp = mesh.dp
        self.index = sharded.coords["dp"] if self.dp > 1 else 0
        # its alias (one name on every rank): the ledger labels the calls "dp" even where the
        # dp ranks are every rank and the group is the default one
        self.group = sharded.group_name(("dp",)) if self.dp > 1 else None
        self.entries = []           # (ParamPlan, local parameter, chunk length)
        chunks = []
        for pp, p in unique_params(sharded):
            if not p.requires_grad:     # frozen (a base under LoRA): no gradient, no optimizer state
                continue
            if not p.is_contiguous():
                raise ConfigError(f"ZeRO: parameter {pp.name} is not contiguous")
            c = math.ceil(p.numel() / self.dp)
            lo, hi = min(self.index * c, p.numel()), min((self.index + 1) * c, p.numel())
            chunks.append(p.detach().view(-1)[lo:hi])        # a view: the update writes into the parameter
            self.entries.append((pp, p, c))
        super().__init__(chunks, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._ready = False          # chunk gradients set for this step
        self._gshard: list[torch.Tensor | None] = [None] * len(self.entries)
        self._handles = []
        if stage == 2 and self.dp > 1:
            self._shard_gradients()

    # ------------------------------------------------------------ gradients
    def _shard_gradients(self) -> None:
        """Stage 2: the parameter hooks all-reduce over the TP part of each
        parameter's gradient sync only; once autograd has accumulated a gradient, it
        joins a bucket that is reduce-scattered over ``dp`` once it holds
        :data:`~autoshard.ir.plan.GRAD_BUCKET_BYTES` (the rest at the end of backward),
        each parameter's part landing in this replica's chunk, and is freed."""
        self.sharded.set_grad_sync(exclude=("dp",))
        self._bucket: list = []          # (entry index, gradient padded to dp chunks)
        self._bucket_bytes = 0
        self._flush_queued = False
        for k, (pp, p, c) in enumerate(self.entries):
            # a parameter whose plan has no dp in its gradient sync gets the gradient
            # already summed over dp (the all-reduce ran on an activation's gradient,
            # e.g. GPT-2's position lookup): each replica keeps its chunk of it
            summed = "dp" not in pp.grad_sync
            self._handles.append(p.register_post_accumulate_grad_hook(self._shard_hook(k, summed)))

    def _shard_hook(self, k: int, summed: bool):
        def hook(p):
            c = self.entries[k][2]
            lo, hi = self._bounds(k)
            flat = p.grad.reshape(-1)
            if summed:
                self._add(k, flat[lo:hi].clone())
            else:
                if not self._flush_queued:      # once per backward: the last bucket after autograd's last node
                    torch.autograd.Variable._execution_engine.queue_callback(self._flush)
                    self._flush_queued = True
                self._bucket.append((k, torch.nn.functional.pad(flat, (0, c * self.dp - flat.numel()))))
                self._bucket_bytes += c * self.dp * flat.element_size()
                if self._bucket_bytes >= GRAD_BUCKET_BYTES:
                    self._flush()
            p.grad = None
        return hook

    def _add(self, k: int, part: torch.Tensor) -> None:
        self._gshard[k] = part if self._gshard[k] is None else self._gshard[k] + part

    def _flush(self) -> None:
        """Reduce-scatter the bucket's gradients over ``dp`` in one call: laid out as a
        ``[dp, Σ chunks]`` block, row ``r`` holds every gradient's chunk ``r``, so this
        replica's row comes back; summed element by element as one call per parameter sums."""
        bucket, self._bucket, self._bucket_bytes = self._bucket, [], 0
        self._flush_queued = False
        if not bucket:
            return
        rows = torch.cat([g.view(self.dp, -1) for _, g in bucket], dim=1)
        mine = C.reduce_scatter(rows.reshape(-1), 0, self.group)
        off = 0
        for k, _ in bucket:
            c = self.entries[k][2]
            lo, hi = self._bounds(k)
            self._add(k, mine[off:off + hi - lo].clone())
            off += c

    def _bounds(self, k: int) -> tuple[int, int]:
        n, c = self.entries[k][1].numel(), self.entries[k][2]
        return min(self.index * c, n), min((self.index + 1) * c, n)

    def _prepare(self) -> None:
        """Give each chunk its gradient (once per step)."""
        if self._ready:
            return
        for k, chunk in enumerate(self.param_groups[0]["params"]):
            p = self.entries[k][1]
            if self.stage == 2 and self.dp > 1:
                chunk.grad = self._gshard[k]
            else:
                lo, hi = self._bounds(k)
                chunk.grad = None if p.grad is None else p.grad.reshape(-1)[lo:hi]
        self._ready = True

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of all gradients, each dense entry counted once (collective)."""
        import torch.distributed as dist

        from ..sharded.grads import replicas

        self._prepare()
        total = torch.zeros((), dtype=torch.float64, device=self.sharded.device)     # NCCL: device tensors only
        for k, chunk in enumerate(self.param_groups[0]["params"]):
            if chunk.grad is not None:
                # the dp replicas hold disjoint chunks: only the TP copies repeat an entry
                total += chunk.grad.detach().double().pow(2).sum() / (replicas(self.entries[k][0], self.sharded.mesh)
                                                                      / self.dp)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        return total.sqrt()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` as
        :func:`torch.nn.utils.clip_grad_norm_` does on the dense model; returns the norm."""
        norm = self.grad_norm()
        coef = (float(max_norm) / (norm + 1e-6)).clamp(max=1.0)     # on the device: no host sync
        for chunk in self.param_groups[0]["params"]:
            if chunk.grad is not None:
                chunk.grad = chunk.grad * coef.to(chunk.grad.dtype)
        return norm.float()

    # ------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """AdamW on this replica's chunks, then one all-gather over ``dp`` of every
        updated chunk (a single flat buffer) into the whole local parameters."""
        loss = closure() if closure is not None else None
        self._prepare()
        super().step()
        self._ready = False
        if self.dp > 1:
            self._all_gather_params()
        return loss

    def _all_gather_params(self) -> None:
        sizes = [c for _, _, c in self.entries]
        send = torch.cat([torch.nn.functional.pad(chunk.reshape(-1), (0, c - chunk.numel()))
                          for chunk, c in zip(self.param_groups[0]["params"], sizes)])
        full = C.all_gather(send, 0, self.group).view(self.dp, -1)
        off = 0
        for (_, p, c) in self.entries:
            p.detach().view(-1).copy_(full[:, off:off + c].reshape(-1)[:p.numel()])
            off += c

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for _, p, _ in self.entries:
            p.grad = None
        self._gshard = [None] * len(self.entries)
        self._ready = False

    # ------------------------------------------------------------ checkpoints
    def gathered(self) -> torch.optim.AdamW:
        """A plain AdamW over ``sharded``'s trainable parameters holding the whole TP-local state
        (the chunks all-gathered over ``dp``), as an unsharded optimizer would hold it:
        what :func:`autoshard.training.train.save_state` stores. Collective."""
        group = self.param_groups[0]
        opt = torch.optim.AdamW([p for p in self.sharded.parameters() if p.requires_grad], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                weight_decay=group["weight_decay"])
        for key in ("initial_lr",):
            if key in group:
                opt.param_groups[0][key] = group[key]
        chunks = group["params"]
        if not self.state.get(chunks[0]):
            return opt          # no step taken yet
        moments = {}
        for key in ("exp_avg", "exp_avg_sq"):
            send = torch.cat([torch.nn.functional.pad(self.state[ch][key].reshape(-1), (0, c - ch.numel()))
                              for ch, (_, _, c) in zip(chunks, self.entries)])
            moments[key] = C.all_gather(send, 0, self.group).view(self.dp, -1) if self.dp > 1 else send.view(1, -1)
        off = 0
        for ch, (_, p, c) in zip(chunks, self.entries):
            opt.state[p] = {"step": self.state[ch]["step"].clone(),
                            **{key: m[:, off:off + c].reshape(-1)[:p.numel()].view_as(p).clone()
                               for key, m in moments.items()}}
            off += c
        return opt

    @classmethod
    def from_optimizer(cls, sharded, optimizer, *, stage: int = 1) -> "ZeroAdamW":
        """A ZeroAdamW holding this replica's chunks of a plain AdamW's state over
        ``sharded.parameters()`` (e.g. one :func:`autoshard.load_checkpoint` restored,
        saved at any dp)."""
        g = optimizer.param_groups[0]
        z = cls(sharded, stage=stage, lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"])
        if "initial_lr" in g:
            z.param_groups[0]["initial_lr"] = g["initial_lr"]
        for k, (ch, (_, p, _)) in enumerate(zip(z.param_groups[0]["params"], z.entries)):
            st = optimizer.state.get(p)
            if not st:
                continue
            lo, hi = z._bounds(k)
            z.state[ch] = {"step": st["step"].clone(),
                           **{key: st[key].reshape(-1)[lo:hi].clone() for key in ("exp_avg", "exp_avg_sq")}}
        return z
