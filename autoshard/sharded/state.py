"""A sharded module's state in and out: any state dict (local, DTensor or dense)
turned into this rank's local tensors for ``load_state_dict``, and the dense Hugging
Face (or peft) folder ``save_pretrained`` writes. The gathering and the file formats
themselves are :mod:`autoshard.io`'s."""

from __future__ import annotations

import torch

__all__ = ["local_state_dict", "save_pretrained"]


def local_state_dict(sharded, state_dict):
    """``state_dict`` as ``sharded``'s local tensors (see
    :meth:`~autoshard.module.ShardedModule.load_state_dict`): a dense tensor of a planned
    parameter sliced to this rank's block through the plan's spec, a DTensor laid out as
    the plan lays it its local tensor (others gathered whole and sliced: collective), a
    local tensor as it is; FSDP2's parameters take their own dp chunk."""
    from torch.distributed.tensor import DTensor

    from ..io.dtensor import from_dtensor, like_fsdp

    plans = sharded.plan.params_by_name()
    local = type(state_dict)() if isinstance(state_dict, dict) else {}
    for k, v in state_dict.items():
        pp = plans.get(k)
        if isinstance(v, DTensor):
            v = from_dtensor(sharded, pp, v) if pp is not None else v.full_tensor()
        elif pp is not None and isinstance(v, torch.Tensor):
            gshape = tuple(pp.global_shape)
            if tuple(v.shape) == pp.hf_shape and pp.pad_dim is not None:
                v = pp.pad(v.detach())      # a dense tensor of a padded vocabulary
            if tuple(v.shape) == gshape and pp.spec.local_shape(gshape, sharded.mesh) != gshape:
                v = pp.spec.local(v.detach(), sharded.mesh, sharded.rank)
        local[k] = v
    if hasattr(state_dict, "_metadata"):
        local._metadata = state_dict._metadata
    params = dict(sharded.named_parameters(remove_duplicate=False))
    for k, v in local.items():      # FSDP2's parameters take their own dp chunk of the TP-local block
        p = params.get(k)
        if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
            local[k] = like_fsdp(p, v)
    return local


def save_pretrained(sharded, path, *, config=None, max_shard_size="5GB", merged: bool = False) -> None:
    """What :meth:`~autoshard.module.ShardedModule.save_pretrained` writes (see there):
    a peft module's adapters (or, ``merged``, the base with them merged), else the dense
    model. Collective: every rank calls it (rank 0 writes)."""
    adapters = getattr(sharded, "adapters", None)
    if adapters is not None and not merged:
        adapters.save(sharded, path)
        return
    if adapters is not None:
        from ..io.gather import save_merged
        save_merged(sharded, path, adapters.merged, config=config, max_shard_size=max_shard_size)
        return
    from ..io.gather import save_pretrained as save_dense
    save_dense(sharded, path, config=config, max_shard_size=max_shard_size)
