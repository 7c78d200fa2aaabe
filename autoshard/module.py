"""``ShardedModule``: the rewritten graph behind the Hugging Face call signature."""

from __future__ import annotations

import torch
from torch import fx, nn

from . import collectives as C
from .errors import ConfigError
from .plan import ShardingPlan

__all__ = ["ShardedModule"]


class ShardedModule(nn.Module):
    """One rank's part of a sharded model.

    Takes the keyword arguments of the Hugging Face model it came from and
    returns the same ``ModelOutput`` (``loss`` is the global mean, identical on
    every rank; ``logits`` are full unless sharded with ``gather_logits=False``).
    Its parameters are local slices under the Hugging Face names; gradients of
    replicated parameters are all-reduced over the axes the plan names as soon
    as backward produces them.
    """

    def __init__(self, gm: fx.GraphModule, plan: ShardingPlan, *, rank: int, groups: dict[str, str],
                 input_names: tuple[str, ...], constants: dict, example_inputs: dict):
        super().__init__()
        object.__setattr__(self, "_gm", gm)          # not registered: its children are ours (HF names)
        for name, child in gm.named_children():
            if not name.startswith("_"):
                self.add_module(name, child)
        self.plan = plan
        self.rank = rank
        self.groups = groups
        self.mesh = plan.mesh
        self.coords = plan.mesh.coords(rank)
        self._input_names = input_names
        self._constants = dict(constants)
        self._tensor_inputs = {k for k, v in example_inputs.items() if isinstance(v, torch.Tensor)}
        self._hooks = []
        params = dict(self.named_parameters(remove_duplicate=False))
        for pp in plan.params:
            if pp.grad_sync and pp.name in params:
                group = groups[",".join(pp.grad_sync)]
                self._hooks.append(params[pp.name].register_hook(_sync_hook(group)))

    @property
    def batch_split(self) -> int:
        return self.mesh.size(self.plan.batch_axes) if self.plan.batch_axes else 1

    def forward(self, **kwargs):
        unknown = set(kwargs) - set(self._input_names)
        if unknown:
            raise ConfigError(f"unexpected input(s) {sorted(unknown)}; this module was captured with "
                              f"{list(self._input_names)} (pass example_inputs to shard() to capture others)")
        full = {}
        for name in self._input_names:
            if name in kwargs and kwargs[name] is not None:
                full[name] = kwargs[name]
            elif name in self._constants:
                full[name] = self._constants[name]
            elif name == "attention_mask" and "input_ids" in kwargs:
                full[name] = torch.ones_like(kwargs["input_ids"])
            else:
                raise ConfigError(f"input {name!r} is required: the graph was captured with it")
        ids = full.get("input_ids")
        split = self.batch_split
        if isinstance(ids, torch.Tensor) and split > 1 and ids.shape[0] % split:
            b = ids.shape[0]
            raise ConfigError(f"batch size {b} is not divisible by the batch split {split} "
                              f"({'·'.join(self.plan.batch_axes)}); use a multiple of {split}, e.g. "
                              f"{max(split, b - b % split)} or {b - b % split + split}")
        return self._gm(**full)

    def graph_module(self) -> fx.GraphModule:
        return self._gm

    # -- checkpoints: implemented in autoshard.checkpoint (collective: call on every rank)
    def full_state_dict(self, rank0_only: bool = True) -> dict:
        """Dense tensors under HF names (tied aliases included), gathered tensor by tensor."""
        from .checkpoint import full_state_dict
        return full_state_dict(self, rank0_only=rank0_only)

    def save_checkpoint(self, path, optimizer=None) -> None:
        """Sharded checkpoint (a safetensors file per rank + manifest); see autoshard.load_checkpoint."""
        from .checkpoint import save_checkpoint
        save_checkpoint(self, path, optimizer)

    def save_pretrained(self, path, *, config=None, max_shard_size="5GB") -> None:
        """Dense Hugging Face folder (config.json + safetensors) that transformers loads."""
        from .checkpoint import save_pretrained
        save_pretrained(self, path, config=config, max_shard_size=max_shard_size)


def _sync_hook(group: str):
    def hook(grad):
        return C._all_reduce(grad, group, "sum")
    return hook
