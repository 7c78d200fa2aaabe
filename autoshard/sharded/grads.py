"""A sharded module's gradients: their sync over the axes the plan names, and their
global norm (torch's ``clip_grad_norm_`` on the module's parameters included).

:class:`GradSync` holds the hooks :meth:`~autoshard.module.ShardedModule.set_grad_sync`
(one blocking all-reduce per parameter) or
:meth:`~autoshard.module.ShardedModule.overlap_grad_sync` (buckets launched during
backward, :mod:`autoshard.runtime.overlap`) register.
"""

from __future__ import annotations

import math
import weakref

import torch

from ..io.gather import unique_params
from ..ir.errors import ConfigError
from ..runtime import collectives as C

__all__ = ["GradSync", "synced_params", "sync_hook", "replicas", "grad_norm", "local_grad", "track"]


class GradSync:
    """The gradient hooks of one sharded module: one all-reduce per parameter, or the
    bucketed sync (:class:`~autoshard.runtime.overlap.BucketedGradSync`), or none."""

    def __init__(self) -> None:
        self._hooks: list = []
        self._bucketed = None        # autoshard.runtime.overlap.BucketedGradSync after bucketed()

    def per_parameter(self, sharded, exclude: tuple[str, ...] = ()) -> None:
        """One blocking all-reduce hook per synced parameter of ``sharded`` (see
        :func:`synced_params`), replacing the hooks it had."""
        self.clear()
        for p, group in synced_params(sharded, exclude):
            self._hooks.append(p.register_hook(sync_hook(group)))

    def bucketed(self, sharded, bucket_bytes: int, exclude: tuple[str, ...] = ()) -> None:
        """Buckets of about ``bucket_bytes`` launched asynchronously during backward,
        replacing the hooks it had."""
        from ..runtime.overlap import BucketedGradSync

        self.clear()
        params = synced_params(sharded, exclude)
        self._bucketed = BucketedGradSync(params, bucket_bytes, {name: label for label, name in sharded.groups.items()})

    def clear(self) -> None:
        """Remove every hook (whoever takes the parameters over syncs their gradients)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._bucketed is not None:
            self._bucketed.remove()
            self._bucketed = None


def synced_params(sharded, exclude: tuple[str, ...]) -> list:
    """(parameter, group name) for every trainable parameter of ``sharded`` whose gradient
    the plan syncs over axes not in ``exclude`` (process groups created as needed,
    collectively). A frozen one (``requires_grad=False``) has no gradient to sync and takes
    no hook."""
    params = dict(sharded.named_parameters(remove_duplicate=False))
    out = []
    for pp in sharded.plan.params:
        axes = tuple(a for a in pp.grad_sync if a not in exclude)
        if not axes or pp.name not in params or not pp.trainable or not params[pp.name].requires_grad:
            continue
        out.append((params[pp.name], sharded.group_name(axes)))
    return out


def sync_hook(group: str):
    """A gradient hook that sums the gradient over ``group`` (a counted all-reduce)."""
    def hook(grad):
        return C.all_reduce(grad, group, "sum")
    return hook


def replicas(pp, mesh) -> int:
    """Ranks holding an identical copy of this rank's block: product of the sizes of
    the mesh axes the parameter is not split over (dp included)."""
    split = set(pp.spec.axes)
    return math.prod(s for a, s in zip(mesh.axes, mesh.sizes) if a not in split)


# ------------------------------------------------------ gradient norms
def grad_norm(sharded, only=None) -> torch.Tensor:
    """The global L2 norm of all gradients (``only``: of these parameters' gradients), each
    dense entry counted once (collective: every rank passes the same parameters)."""
    import torch.distributed as dist

    total = torch.zeros((), dtype=torch.float64, device=sharded.device)     # NCCL reduces device tensors only
    keep = None if only is None else {id(p) for p in only}
    for pp, p in unique_params(sharded):
        if p.grad is None or (keep is not None and id(p) not in keep):
            continue
        g, copies = local_grad(p), replicas(pp, sharded.mesh)
        if g is not p.grad:         # FSDP2: this rank's dp chunk of the TP block, held once over dp
            copies //= sharded.mesh.dp
        total += g.detach().double().pow(2).sum() / copies
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt()


def local_grad(p) -> torch.Tensor:
    """``p.grad``, or its local tensor where FSDP2 made it a DTensor over ``dp``."""
    g = p.grad
    return g.to_local() if hasattr(g, "to_local") else g


# ------------------------------------------------------ torch's clip_grad_norm_
# torch.nn.utils.clip_grad_norm_ on a sharded module's parameters would compute the norm of
# this rank's local gradients only (plain tensors: a TP block of some, a replica of others).
# Its total norm comes from torch.nn.utils.clip_grad._get_total_norm and the scaling from
# _clip_grads_with_norm_; the first ShardedModule wraps both so that gradients of a live sharded module
# get their global norm (grad_norm, as autoshard.training.train.clip_grad_norm_) and are scaled as
# ours are (FSDP2's DTensor gradients through their local chunks), every other call passing
# through to torch.
_SHARDED: "weakref.WeakSet" = weakref.WeakSet()


def track(sharded) -> None:
    """Let torch's ``clip_grad_norm_`` see ``sharded``'s gradients as sharded (see above)."""
    _SHARDED.add(sharded)
    import torch.nn.utils.clip_grad as cg

    if getattr(cg, "_get_total_norm", None) is None or getattr(cg._get_total_norm, "_autoshard", False):
        return
    torch_total_norm = cg._get_total_norm

    def _get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        found = _owner(ts)
        if found is None:
            return torch_total_norm(ts, norm_type, error_if_nonfinite, foreach)
        if float(norm_type) != 2.0:
            raise ConfigError(f"torch.nn.utils.clip_grad_norm_(norm_type={norm_type}) on a sharded module's parameters: "
                              f"only the L2 norm is global here; use norm_type=2 or "
                              f"autoshard.training.train.clip_grad_norm_(sharded, max_norm)")
        norm = grad_norm(*found)
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(f"the total norm of order 2.0 for the gradients of the sharded module is non-finite "
                               f"({norm.item()}), so it cannot be clipped")
        return norm.float()

    torch_clip_with_norm = cg._clip_grads_with_norm_

    def _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        ps = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _owner([p.grad for p in ps if p.grad is not None]) is None:
            return torch_clip_with_norm(ps, max_norm, total_norm, foreach)
        coef = (float(max_norm) / (total_norm + 1e-6)).clamp(max=1.0)     # torch's coefficient
        for p in ps:            # FSDP2's DTensor gradients: their local chunks, as clip_grad_norm_ above
            if p.grad is not None:
                local_grad(p).mul_(coef.to(p.grad.dtype))

    _get_total_norm._autoshard = True
    cg._get_total_norm = _get_total_norm
    if getattr(cg, "_clip_grads_with_norm_", None) is not None:
        cg._clip_grads_with_norm_ = _clip_grads_with_norm_


def _owner(grads: list) -> tuple | None:
    """``(sharded, params)`` when ``grads`` are gradients of one tracked sharded module's
    parameters; None when none is; an error naming ours when they mix."""
    if not grads:
        return None
    ids = {id(g) for g in grads}
    for sharded in list(_SHARDED):
        params = [p for p in sharded.parameters() if p.grad is not None and id(p.grad) in ids]
        if not params:
            continue
        if len(params) != len(ids):
            raise ConfigError(f"torch.nn.utils.clip_grad_norm_ got {len(params)} gradients of a sharded module and "
                              f"{len(ids) - len(params)} other tensors: their total norm has no one meaning across "
                              f"ranks; clip the sharded module's own with "
                              f"autoshard.training.train.clip_grad_norm_(sharded, max_norm)")
        return sharded, params
    return None
