"""``ShardedModule``: the rewritten graph behind the Hugging Face call signature."""

from __future__ import annotations

import torch
from torch import fx, nn

from . import collectives as C
from . import parallel_ops
from .errors import ConfigError
from .plan import ShardingPlan
from .validate import Problem as _P

__all__ = ["ShardedModule"]


class ShardedModule(nn.Module):
    """One rank's part of a sharded model.

    Takes the keyword arguments of the Hugging Face model it came from and
    returns the same ``ModelOutput`` (``loss`` is the global mean, identical on
    every rank; ``logits`` are full unless sharded with ``gather_logits=False``).
    Its parameters are local slices under the Hugging Face names; gradients of
    replicated parameters are all-reduced over the axes the plan names as soon
    as backward produces them.

    It answers as the model does: ``.config``, ``.generation_config``, ``.device``,
    ``.dtype``. State: ``state_dict()`` is this rank's local slices (under HF names);
    ``full_state_dict()`` the dense tensors (collective); ``load_state_dict`` takes
    either and slices a dense one through the plan::

        sharded.load_state_dict(dense_model.state_dict())     # every rank, no collective
    """

    def __init__(self, gm: fx.GraphModule, plan: ShardingPlan, *, rank: int, groups: dict[str, str],
                 input_names: tuple[str, ...], constants: dict, example_inputs: dict, debug: bool = False):
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
        self.debug = debug
        self._limits: dict = {}      # {"vocab_size": (name, n), "max_positions": (name, n)}, set by shard()
        self._config = None
        self._generation_config = None
        params = dict(self.named_parameters(remove_duplicate=False))
        for pp in plan.params:
            if pp.grad_sync and pp.name in params:
                group = groups[",".join(pp.grad_sync)]
                self._hooks.append(params[pp.name].register_hook(_sync_hook(group)))

    # -- looks like the Hugging Face model
    @property
    def config(self):
        """The Hugging Face config of the model this module was sharded from (None if unknown)."""
        return self._config

    @config.setter
    def config(self, value) -> None:
        self._config = value

    @property
    def generation_config(self):
        """The model's generation config: the one set, else derived from :attr:`config`."""
        if self._generation_config is None and self._config is not None:
            from transformers import GenerationConfig

            self._generation_config = GenerationConfig.from_model_config(self._config)
        return self._generation_config

    @generation_config.setter
    def generation_config(self, value) -> None:
        self._generation_config = value

    @property
    def device(self) -> torch.device:
        """Device of the local parameters."""
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the floating local parameters (the first one's)."""
        return next((p.dtype for p in self.parameters() if p.is_floating_point()), torch.get_default_dtype())

    def __repr__(self) -> str:
        p = self.plan
        local = sum(t.numel() * t.element_size() for t in self.parameters())
        return (f"ShardedModule({p.model}, mode={p.mode}, mesh={self.mesh}, rank={self.rank}, "
                f"params={len(p.params)}, local_bytes={local:,})")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load this rank's local state dict, or a full (dense) one, as DTensor / FSDP2 do.

        A tensor of a planned parameter with the global shape (where that differs
        from the local one) is sliced to this rank's block through the plan's spec
        (:meth:`~autoshard.spec.ShardSpec.local`); local tensors load as they are.
        No collective: every rank slices its own part."""
        plans = {n: pp for pp in self.plan.params for n in (pp.name, *pp.aliases)}
        local = type(state_dict)() if isinstance(state_dict, dict) else {}
        for k, v in state_dict.items():
            pp = plans.get(k)
            if pp is not None and isinstance(v, torch.Tensor):
                gshape = tuple(pp.global_shape)
                if tuple(v.shape) == gshape and pp.spec.local_shape(gshape, self.mesh) != gshape:
                    v = pp.spec.local(v.detach(), self.mesh, self.rank)
            local[k] = v
        if hasattr(state_dict, "_metadata"):
            local._metadata = state_dict._metadata
        return super().load_state_dict(local, strict=strict, assign=assign)

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
        self._check_inputs(full)
        split = self.batch_split
        if isinstance(ids, torch.Tensor) and split > 1 and ids.shape[0] % split:
            b = ids.shape[0]
            raise ConfigError(f"batch size {b} is not divisible by the batch split {split} "
                              f"({'·'.join(self.plan.batch_axes)}); use a multiple of {split}, e.g. "
                              f"{max(split, b - b % split)} or {b - b % split + split}")
        if self.debug:
            self._check_same_inputs(full)
        with parallel_ops.dropout_active(self.training):     # sharded.eval() turns dropout off, as in the model
            return self._gm(**full)

    def _check_inputs(self, full: dict) -> None:
        """Shapes and dtypes a call must have; local and cheap (no collective)."""
        from .validate import check_example_inputs

        ids = full.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            return
        problems = [p for p in check_example_inputs(full) if "capture needs" not in p.message]
        if ids.dim() == 2:
            s = ids.shape[1]
            if s < 2:
                problems.append(_P("input_ids", f"sequence length {s}: the graph was captured for seq >= 2"))
            lim = self._limits.get("max_positions")
            if lim and s > lim[1]:
                problems.append(_P("input_ids", f"sequence length {s} exceeds the model's {lim[0]}={lim[1]}"))
            voc = self._limits.get("vocab_size")
            if voc and ids.numel() and not ids.dtype.is_floating_point:
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0 or hi >= voc[1]:
                    problems.append(_P("input_ids", f"token ids span {lo}..{hi}, outside the vocabulary "
                                                    f"0..{voc[1] - 1} (a vocab-parallel embedding would "
                                                    f"silently read zeros)"))
        if problems:
            from .validate import raise_problems
            raise_problems(problems, "ShardedModule call")

    def _check_same_inputs(self, full: dict) -> None:
        """``debug=True``: every TP rank of a data-parallel replica must see the same
        inputs. Each rank all-gathers a checksum per input (numel, sum, position-weighted
        sum, in float64) over the default group and compares it with its replica's ranks;
        every rank reaches the same verdict from the same gathered table."""
        import torch.distributed as dist

        names = [n for n in self._input_names if isinstance(full.get(n), torch.Tensor)]
        rows = []
        for n in names:
            x = full[n].detach().reshape(-1).to("cpu", torch.float64)
            w = torch.arange(x.numel(), dtype=torch.float64) % 9973 + 1
            rows.append(torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), x.sum(), (x * w).sum()]))
        mine = torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64)
        world = dist.get_world_size()
        table = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(table, mine)
        dp_of = (lambda r: self.mesh.coords(r)["dp"]) if "dp" in self.mesh.axes else (lambda r: 0)
        bad = []
        for i, n in enumerate(names):
            by_replica: dict = {}
            for r in range(world):
                by_replica.setdefault(dp_of(r), {}).setdefault(tuple(table[r][i].tolist()), []).append(r)
            for rep, sums in sorted(by_replica.items()):
                if len(sums) > 1:
                    groups = "; ".join(f"ranks {rs} see numel={int(k[0])} checksum={k[2]:.12g}" for k, rs in sums.items())
                    bad.append(f"{n!r}" + (f" (dp replica {rep})" if "dp" in self.mesh.axes else "") + f": {groups}")
        if bad:
            raise ConfigError("debug: inputs differ between the TP ranks of a replica, which must all be called "
                              "with the same batch (dp replicas may differ): " + " | ".join(bad))

    def graph_module(self) -> fx.GraphModule:
        return self._gm

    # -- checkpoints: autoshard.gather and autoshard.sharded_format (collective: call on every rank)
    def full_state_dict(self, rank0_only: bool = True) -> dict:
        """Dense tensors under HF names (tied aliases included), gathered tensor by tensor;
        the counterpart of ``state_dict()`` (local slices). Call on every rank; with
        ``rank0_only`` the other ranks get ``{}``."""
        from .gather import full_state_dict
        return full_state_dict(self, rank0_only=rank0_only)

    def save_checkpoint(self, path, optimizer=None) -> None:
        """Sharded checkpoint (a safetensors file per rank + manifest); see autoshard.load_checkpoint."""
        from .sharded_format import save_checkpoint
        save_checkpoint(self, path, optimizer)

    def save_pretrained(self, path, *, config=None, max_shard_size="5GB") -> None:
        """Dense Hugging Face folder (config.json + safetensors) that transformers loads."""
        from .gather import save_pretrained
        save_pretrained(self, path, config=config, max_shard_size=max_shard_size)


def _sync_hook(group: str):
    def hook(grad):
        return C.all_reduce(grad, group, "sum")
    return hook
