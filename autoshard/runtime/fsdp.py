"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over a sharded module's ``dp`` axis.

With ``dp`` replicas every one of them holds the same tensor-parallel block of each
parameter. :func:`fully_shard_dp` hands the module to torch's FSDP2 on the ``dp``
sub-mesh of :attr:`~autoshard.module.ShardedModule.device_mesh`: at rest each rank
keeps ``1/dp`` of its TP block (parameters, gradients and, with an optimizer built
afterwards, its state: dense / (tp · dp) bytes per rank); the module's forward
all-gathers them over ``dp`` and frees them after, backward gathers them again and
reduce-scatters the gradients over ``dp``::

    sharded = autoshard.shard(model, mode="2d", dp=2, example_inputs=batch, fsdp=True)
    opt = torch.optim.AdamW(sharded.parameters(), lr=3e-4)      # DTensor parameters over dp

How the module's own gradient sync meets FSDP's (``docs/design.md``, FSDP2):

* the loss is the global mean over every replica's rows, so FSDP reduces with a
  plain sum (divide factor 1; gloo has no pre-multiplied sum, so a sum it is);
* the TP part of each parameter's gradient sync (a norm weight replicated over the
  TP ranks) stays ours: a hook on FSDP's unsharded parameter all-reduces it over the
  TP axes before FSDP reduce-scatters over ``dp``;
* a gradient the graph already summed over ``dp`` (its all-reduce ran on an
  activation's gradient: GPT-2's position lookup) is divided by ``dp`` before FSDP's
  sum, so it is counted once.

Each repeated block of the model (``model.layers.3``) becomes a module the graph calls
(:meth:`~autoshard.module.ShardedModule.split_blocks`, :mod:`autoshard.passes.blocks`) and
its own FSDP unit, the root (embeddings, head, final norm) the last one: FSDP gathers one
block's parameters in the block's forward pre-hook and frees them after, so a step holds
the root's and one block's TP blocks whole at a time. The graph reads parameters through
the modules that register them, which FSDP swaps; a parameter registered on the root
itself is refused (ZeRO stays for such a model).
"""

from __future__ import annotations

import torch

from ..ir.errors import ConfigError
from . import collectives as C

__all__ = ["fully_shard_dp"]


def fully_shard_dp(sharded, *, reshard_after_forward: bool = True, per_block: bool = True,
                   checkpoint: bool = False):
    """Shard ``sharded``'s parameters over its ``dp`` axis with torch's FSDP2 (see the
    module docstring). Returns the module (now also an ``FSDPModule``). Call on every
    rank, before building the optimizer. ``checkpoint``: each block also recomputes its
    activations in backward (inside its FSDP unit, as torchtitan composes them)."""
    from torch.distributed.fsdp import fully_shard

    mesh = sharded.mesh
    if mesh.dp == 1:
        raise ConfigError(f"fsdp=True shards over the dp axis, and this module has none (mesh {mesh}): "
                          f"pass dp=D with D > 1")
    top = [n for n, _ in sharded.named_parameters(recurse=False)]
    if top:
        raise ConfigError(f"fsdp=True: the graph reads the top-level parameter(s) {top} outside the module's "
                          f"children, where FSDP cannot swap them; use ZeRO (make_optimizer(zero=2)) for this model")
    sharded.clear_grad_sync()           # ours were on the parameters FSDP replaces: they go on its unsharded ones
    dp_mesh = sharded.device_mesh["dp"]
    blocks = sharded.split_blocks(checkpoint=checkpoint) if per_block else []
    units = [sharded.get_submodule(k) for k in blocks] + [sharded]
    plans = sharded.plan.params_by_name()
    owner = {}      # (id(module), attribute) -> ParamPlan
    for mname, mod in sharded.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if full in plans:
                owner[(id(mod), pname)] = plans[full]
    for unit in units:                  # the blocks first, the root (what is left) last
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fsdp_params = []
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
        unit.unshard()                  # FSDP's unsharded parameters exist from here on
        group = fully_shard.state(unit)._fsdp_param_group
        fsdp_params += group.fsdp_params if group is not None else []
    for fp in fsdp_params:
        info = fp._module_info
        pp = owner.get((id(info.module), info.param_name))
        if pp is None or not fp.sharded_param.requires_grad:
            continue
        tp = tuple(a for a in pp.grad_sync if a != "dp")
        summed = "dp" not in pp.grad_sync
        if not (tp or summed):
            continue
        fp._unsharded_param.register_hook(_sync_hook(sharded.group_name(tp) if tp else None,
                                                     mesh.dp if summed else 1))
    for unit in units:
        unit.reshard()
    return sharded


def _sync_hook(group: str | None, divide: int):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if group is not None:
            grad = C.all_reduce(grad, group, "sum")
        return grad / divide if divide != 1 else grad
    return hook
