"""Pipeline parallelism: ``shard(model, mode=..., pp=P, schedule=...)``.

``pp`` is the outermost mesh axis: world = pp × (dp × cp × the mode's mesh), and ranks
``i·W .. (i+1)·W - 1`` (``W = world / pp``) hold stage ``i``, so the stages go across
nodes first and tensor parallelism stays inside one. The model is captured once and
planned once under the mode's policy on ``W`` ranks (every stage's layout is today's
sharded graph for its layers, on its own tensor-parallel sub-mesh); each rank rewrites the
graph for its place in its stage's block and :mod:`autoshard.passes.stages` cuts the
rewritten graph between transformer blocks into ``pp × v`` stages balanced on the cost
model's time per block (``v = 2`` for ``"interleaved"`` and ``"zbv"``), carrying every
value that crosses a cut explicitly. The groups a stage's collectives run on are the
plan's axes with the stage's ``pp`` coordinate fixed.

torch's own engine runs them (:mod:`torch.distributed.pipelining`: a ``PipelineStage`` per
stage, ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` /
``ScheduleZBVZeroBubble``), from :func:`autoshard.training.train.train_step` (see
:mod:`autoshard.training.pipeline`). Calling the module without a schedule runs the
forward through the stages (evaluation, no gradients) and returns the outputs on every
rank. A tensor read on stages held by different ranks (a tied embedding and head) has
its gradient summed over them each step. See docs/design.md, "Pipeline parallelism".

Example (under ``torchrun --nproc-per-node 4``)::

    sharded = autoshard.shard(model, mode="1d", pp=2, schedule="1f1b")    # tp 2 × pp 2
    loss, _ = autoshard.training.train.train_step(sharded, micro_batches, optimizer)
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from .ir.errors import ConfigError
from .ir.mesh import Mesh
from .ir.plan import ShardingPlan
from .ir.signature import batch_of, seq_of
from .passes.stages import Stage, balance, blocks_in_order, checkpoint_stages, cut
from .pipeline_plan import (SCHEDULES, PipelinePlan, StageInfo, block_costs, block_memory, bubble, check_pipeline,
                            describe_stages, estimate_stages, plan_pipeline, stage_infos, stage_ranks)
from .planning.validate import Problem, check_dims, check_example_inputs, check_model, raise_problems
from .runtime import collectives as C
from .runtime import parallel_ops

__all__ = ["SCHEDULES", "PipelinePlan", "PipelinedModule", "StageInfo", "bubble", "check_pipeline", "describe_stages",
           "estimate_stages", "plan_pipeline", "shard_pipelined", "stage_ranks"]

def shard_pipelined(model: nn.Module, cfg, *, example_inputs: dict | None = None, ensure_dist=None, weights=None,
                    captured=None) -> "PipelinedModule":
    """:func:`autoshard.shard` with ``cfg.pp`` pipeline stages (see the module doc; ``cfg``:
    its :class:`~autoshard.config.ShardConfig`). Called by it: the launch pipeline's stages
    to the rewritten graph on each stage's ``world / pp`` ranks, then the cut."""
    from .launch.pipeline import PIPELINE, LaunchState
    from .runtime.device import rank_device

    pp, schedule = cfg.pp, cfg.schedule or "1f1b"
    _check_model(model, pp)
    config = getattr(model, "config", None)
    world = int(os.environ.get("WORLD_SIZE", "0") or 0) if not dist.is_initialized() else dist.get_world_size()
    raise_problems(check_pipeline(pp=pp, schedule=schedule, world=world or pp, mode=cfg.mode, config=config,
                                  fsdp=cfg.fsdp, activation_checkpointing=cfg.activation_checkpointing,
                                  weights=weights, auto=True),
                   f"autoshard.shard(mode={cfg.mode!r}, pp={pp}, schedule={schedule!r})")
    if ensure_dist is not None:
        ensure_dist()
    world, rank = dist.get_world_size(), dist.get_rank()
    W = world // pp
    pol = _stage_policy(model, cfg, schedule, world, example_inputs)
    device = torch.device(cfg.device) if cfg.device is not None else rank_device()
    frozen = frozenset(n for n, t in model.named_parameters(remove_duplicate=False) if not t.requires_grad)
    state = PIPELINE.run(LaunchState(config=cfg, model=model, example_inputs=example_inputs, world_size=W, rank=rank,
                                     captured=captured, policy=pol, frozen=frozen, checks="rng", local_rank=rank % W),
                         "capture", "prepare")
    ex = state.prepared.example_inputs
    b, s = batch_of(ex), seq_of(ex) or 1
    split = state.policy.batch_split()[0]
    if b % split:
        raise ConfigError(f"example batch {b} does not divide the batch split {split} of mode {cfg.mode!r}: "
                          f"with pp > 1 pass example_inputs whose batch is a multiple of {split}")
    state = PIPELINE.run(state.but(batch_size=b * state.policy.dp, seq_len=s), "plan")
    p = state.plan
    mesh = Mesh(axes=("pp",) + p.mesh.axes, sizes=(pp,) + p.mesh.sizes)
    state = PIPELINE.run(state.but(group_mesh=mesh), "groups", "rewrite")
    return _cut(state, mesh, schedule, device)


def _check_model(model, pp: int) -> None:
    """A plain module (no folder path, no peft wrapper: not built with pp > 1 yet)."""
    from .adapters import is_peft_model

    if not isinstance(model, nn.Module):
        raise ConfigError(f"shard(..., pp={pp}) takes a torch.nn.Module; got {type(model).__name__} "
                          f"(a folder path is not built with pp > 1 yet: load the model, then shard it)")
    if is_peft_model(model):
        raise ConfigError(f"shard(peft model, pp={pp}): adapters are not built with pp > 1 yet; valid: pp=1, or "
                          f"merge the adapters first (model.merge_and_unload())")


def _stage_policy(model, cfg, schedule: str, world: int, example_inputs):
    """The layout of each stage's ``world / pp`` ranks (None with ``mode="auto"``: the
    pipeline's prepare stage searches it), every problem raised before any collective."""
    pp, config = cfg.pp, getattr(model, "config", None)
    W = world // pp
    problems = check_pipeline(pp=pp, schedule=schedule, world=world, mode=cfg.mode, config=config, auto=True)
    pol = None
    if cfg.mode != "auto":
        try:
            pol = cfg.policy(W)
        except ConfigError as e:
            problems.append(Problem("mesh", f"each of the {pp} stages has {W} ranks: {e}"))
    problems += check_model(model) + check_example_inputs(example_inputs, config=config)
    if pol is not None:
        problems += check_dims(config, pol)
    if cfg.cp > 1 and cfg.cp_attention == "auto":
        problems.append(Problem("cp_attention", "cp_attention='auto' is not built with pp > 1 yet; valid: 'ring' "
                                                "or 'gather'"))
    raise_problems(problems, f"autoshard.shard(mode={cfg.mode!r}, pp={pp}) on {world} ranks")
    return pol


def _cut(state, mesh: Mesh, schedule: str, device) -> "PipelinedModule":
    """The rank's rewritten graph cut between transformer blocks into the schedule's
    stages, balanced on the cost model's time per block: its PipelinedModule."""
    p, gm, pp, cluster = state.plan, state.gm, state.config.pp, state.config.cluster
    owners = stage_ranks(schedule, pp)
    keys = blocks_in_order(gm.graph)
    costs, head, tail = block_costs(p, keys, cluster)
    if len(keys) < len(owners):
        raise ConfigError(f"pp={pp} with schedule={schedule!r} needs {len(owners)} stages of whole transformer "
                          f"blocks; the graph has {len(keys)} blocks ({', '.join(keys[:4])}): use a smaller pp")
    starts = balance(costs, len(owners), head, tail, **block_memory(p, keys, pp, cluster))
    stages = cut(gm, [keys[i] for i in starts[1:]])
    infos = stage_infos(p, stages, owners, keys, starts, costs, head, tail)
    if state.config.activation_checkpointing:       # after the infos: they read the stages' carried placeholders
        checkpoint_stages(stages)
    return PipelinedModule(stages, infos, p, mesh=mesh, rank=state.rank, groups=state.groups, schedule=schedule,
                           captured=state.captured, model=state.model, device=device)


class _Runner(nn.Module):
    """One stage as ``PipelineStage`` calls it: ``runner(*carried, **inputs)`` (the first
    stage takes the model's main input positionally too, and reads it from the inputs)."""

    def __init__(self, stage: Stage, in_spec, constants: dict):
        super().__init__()
        self.stage_gm = stage.gm
        self.index = stage.index
        self._in_spec = in_spec
        self._constants = dict(constants)

    def forward(self, *args, **inputs):
        from torch.fx._pytree import tree_flatten_spec

        carried = args if self.index else ()
        flat = tree_flatten_spec(((), {**self._constants, **inputs}), self._in_spec)
        with parallel_ops.dropout_active(self.training):
            out = self.stage_gm(*flat, *carried)
        return out if isinstance(out, tuple) else tuple(out)


class PipelinedModule(nn.Module):
    """This rank's stages of a pipeline-parallel model (see the module doc).

    Its parameters are the local slices of its stages' tensors, under their Hugging Face
    names. ``module(**batch)`` runs the forward through every stage (no gradients) and
    returns the model's outputs on every rank; training goes through
    :func:`autoshard.training.train.train_step`, which runs the schedule. ``generate()``
    is refused.
    """

    pipelined = True

    def __init__(self, stages: list[Stage], infos: tuple, plan: ShardingPlan, *, mesh: Mesh, rank: int,
                 groups: dict, schedule: str, captured, model, device):
        super().__init__()
        self.plan = plan
        self.full_mesh = mesh
        self.mesh = plan.mesh
        self.pp = mesh.sizes[0]
        self.rank = rank
        self.local_rank = rank % plan.mesh.world_size
        self.pp_rank = rank // plan.mesh.world_size
        self.coords = plan.mesh.coords(self.local_rank)
        self.groups = groups
        self.schedule = schedule
        self.stages = tuple(infos)
        self.owners = tuple(i.pp_rank for i in infos)
        self.config = getattr(model, "config", None)
        self._device = device
        gm0 = captured.module
        self._in_spec = gm0._in_spec if hasattr(gm0, "_in_spec") else gm0.graph._codegen.pytree_info.in_spec
        self._out_spec = gm0._out_spec if hasattr(gm0, "_out_spec") else gm0.graph._codegen.pytree_info.out_spec
        self._constants = dict(captured.constants)
        self.input_names = tuple(k for k in captured.input_names if k not in self._constants)
        mine = [st for st in stages if self.owners[st.index] == self.pp_rank]
        object.__setattr__(self, "_runners", {st.index: _Runner(st, self._in_spec, self._constants) for st in mine})
        object.__setattr__(self, "_all_stages", stages)
        self._state_keys = frozenset(model.state_dict())
        for st in mine:
            for name, t in list(st.gm.named_parameters(remove_duplicate=False)) + \
                    list(st.gm.named_buffers(remove_duplicate=False)):
                self._place(name, t)
        self._hooks = []
        self._set_grad_sync()
        self.tie_groups = self._tie_groups(stages)       # [(parameter, group)]: summed over pipeline ranks
        self.schedule_cache: dict = {}        # (micro-batches, shapes) -> the schedule (autoshard.training.pipeline)
        self.to(device)
        from .runtime.device import retarget

        for r in self._runners.values():       # the graphs' device literals and constants follow the slices
            retarget(r.stage_gm, device)

    def train(self, mode: bool = True):
        """Train or eval mode for every stage this rank runs (dropout follows it)."""
        super().train(mode)
        for r in self._runners.values():
            r.train(mode)
        return self

    # -- structure
    def _place(self, name: str, t: torch.Tensor) -> None:
        path, _, attr = name.rpartition(".")
        mod = self
        for part in path.split(".") if path else ():
            nxt = mod._modules.get(part)
            if nxt is None:
                nxt = nn.Module()
                mod.add_module(part, nxt)
            mod = nxt
        if isinstance(t, nn.Parameter):
            if attr not in mod._parameters:
                mod.register_parameter(attr, t)
        elif attr not in mod._buffers:
            mod.register_buffer(attr, t)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 holds the parameters: never under pp (not built yet)."""
        return False

    @property
    def stage_indices(self) -> tuple[int, ...]:
        """The stages this rank runs, in order."""
        return tuple(sorted(self._runners))

    def runner(self, index: int) -> nn.Module:
        """The module ``PipelineStage`` runs for stage ``index`` (one of :attr:`stage_indices`)."""
        return self._runners[index]

    def group_name(self, axes: tuple[str, ...]) -> str:
        """This rank's process group over ``axes`` of its stage's block (made collectively
        where new: every rank asks in the same order)."""
        from .runtime.groups import axes_label, group_alias, mesh_group

        label = axes_label(axes)
        if label not in self.groups:
            mesh_group(self.full_mesh, axes, self.rank)
            self.groups[label] = group_alias(self.full_mesh, axes)
        return self.groups[label]

    def pp_group(self):
        """The process group of this rank's pipeline (the ranks with its place in every stage)."""
        from torch.distributed import distributed_c10d as c10d

        return c10d._resolve_process_group(self.group_name(("pp",)))

    def _set_grad_sync(self) -> None:
        """All-reduce each replicated parameter's gradient over its plan's ``grad_sync`` axes of
        the stage's block as backward produces it (as a ShardedModule does)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        for q in self.plan.params:
            if q.grad_sync and q.name in params and q.trainable and params[q.name].requires_grad:
                group = self.group_name(tuple(q.grad_sync))
                self._hooks.append(params[q.name].register_hook(lambda g, group=group: C.all_reduce(g, group, "sum")))

    def _tie_groups(self, stages: list[Stage]) -> list:
        """``[(parameter, group name)]`` for the tensors read on stages of different
        pipeline ranks: their gradients are summed over those ranks each step. Every rank
        creates every such group, in the same order (collective)."""
        from .runtime.groups import ranks_group

        by_name = {n: q.name for q in self.plan.params for n in (q.name, *q.aliases)}
        holders: dict[str, set] = {}
        for st in stages:
            for t in st.tensors:
                if t in by_name:
                    holders.setdefault(by_name[t], set()).add(self.owners[st.index])
        params = dict(self.named_parameters(remove_duplicate=False))
        out, made = [], {}
        W = self.mesh.world_size
        shape = "x".join(f"{a}{s}" for a, s in zip(self.full_mesh.axes, self.full_mesh.sizes))
        for name in sorted(holders):
            pps = tuple(sorted(holders[name]))
            if len(pps) < 2:
                continue
            if pps not in made:     # one group per place in a stage, over the pipeline ranks holding it
                made[pps] = ranks_group([tuple(r * W + loc for r in pps) for loc in range(W)],
                                        f"autoshard/{shape}/tie{'-'.join(map(str, pps))}", self.rank)
            if made[pps] is not None and name in params:
                out.append((params[name], made[pps]))
        return out

    @property
    def tied(self) -> tuple[str, ...]:
        """The parameters whose gradient is summed over pipeline ranks (read on stages of several)."""
        names = {id(p): n for n, p in self.named_parameters(remove_duplicate=False)}
        return tuple(names[id(p)] for p, _ in self.tie_groups)

    def sum_tied_grads(self) -> None:
        """Sum the gradients of the tied tensors over the pipeline ranks that read them
        (collective; :func:`autoshard.training.train.train_step` calls it after the schedule)."""
        for p, group in self.tie_groups:
            if p.grad is not None:
                p.grad.copy_(C.all_reduce(p.grad, group, "sum"))

    def generate(self, *args, **kwargs):
        raise ConfigError(f"generate() on a module sharded with pp={self.pp}: decoding through pipeline stages is "
                          f"not built; generate with a module sharded without pp (the same weights: "
                          f"save_pretrained, then shard(..., pp=1))")

    # -- forward through the stages (evaluation)
    def batch_inputs(self, kwargs: dict) -> dict:
        """A call's (or micro-batch's) tensors checked against the captured inputs and moved
        to the module's device."""
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k not in self._constants}
        missing = [k for k in self.input_names if k not in kwargs]
        extra = [k for k in kwargs if k not in self.input_names]
        if missing or extra:
            raise ConfigError(f"a pipeline-parallel module takes the inputs it was captured with: "
                              f"{', '.join(self.input_names)}; missing {missing or 'none'}, unexpected {extra or 'none'}")
        split = self.mesh.size(self.plan.batch_axes) if self.plan.batch_axes else 1
        b = batch_of(kwargs) or 0
        if split > 1 and b % split:
            raise ConfigError(f"batch size {b} is not divisible by the batch split {split} "
                              f"({'·'.join(self.plan.batch_axes)}); with pp > 1 use a multiple of {split}")
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    def peer_rank(self, stage: int) -> int:
        """The global rank holding ``stage`` in this rank's pipeline."""
        return self.owners[stage] * self.mesh.world_size + self.local_rank

    @torch.no_grad()
    def forward(self, **kwargs):
        """Run the batch through every stage (no gradients; train with
        :func:`autoshard.training.train.train_step`) and return the model's output on
        every rank."""
        batch = self.batch_inputs(kwargs)
        pg = self.pp_group()
        carried: tuple = ()
        n = len(self.owners)
        out = None
        for s in range(n):
            here = self.owners[s] == self.pp_rank
            if here and s and self.owners[s - 1] != self.pp_rank:
                carried = _recv_tensors(self.peer_rank(s - 1), self.group_name(("pp",)), self.device)
            if here:
                out = self._runners[s](*carried, **batch)
                carried = out
                if s + 1 < n and self.owners[s + 1] != self.pp_rank:
                    _send_tensors(carried, self.peer_rank(s + 1), self.group_name(("pp",)))
        last = self.peer_rank(n - 1)
        obj = [tuple(t.cpu() for t in out) if self.rank == last else None]
        dist.broadcast_object_list(obj, src=last, group=pg)
        from torch.utils._pytree import tree_unflatten

        return tree_unflatten([t.to(self.device) for t in obj[0]], self._out_spec)

    def loss_index(self) -> int:
        """The position of the loss among the last stage's outputs."""
        from torch.utils._pytree import tree_unflatten

        marks = tree_unflatten(list(range(self._out_spec.num_leaves)), self._out_spec)
        idx = marks.get("loss") if hasattr(marks, "get") else getattr(marks, "loss", None)
        if idx is None:
            raise ConfigError("training with pp > 1 needs the model's loss as an output: pass labels in "
                              "example_inputs (and in every micro-batch)")
        return idx

    # -- state
    def full_state_dict(self, rank0_only: bool = True) -> dict:
        """The dense tensors under Hugging Face names, gathered stage by stage (collective).
        Rank 0 gets them all (every rank with ``rank0_only=False``), the others ``{}``."""
        self._gather_groups()
        params = dict(self.named_parameters(remove_duplicate=False))
        buffers = dict(self.named_buffers(remove_duplicate=False))
        mine: dict = {}
        lead = self.local_rank == 0
        for q in self.plan.params:
            if q.name not in params:
                continue
            full = _gather_block(self, params[q.name].detach(), q.spec, q.global_shape)
            if lead:
                full = q.trim(full).clone()
                for name in (q.name, *q.aliases):
                    mine[name] = full
        if lead:
            for name, b in buffers.items():
                if name in self._state_keys and name not in mine:
                    mine[name] = b.detach().clone()
        return self._collect({k: v.cpu() for k, v in mine.items()}, rank0_only)

    def full_optimizer_state(self, optimizer, rank0_only: bool = True) -> dict:
        """A per-tensor optimizer's state (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``) as
        dense tensors under the Hugging Face names, gathered stage by stage (collective);
        :meth:`load_optimizer_state` takes it at any pp. Rank 0 gets it (every rank with
        ``rank0_only=False``), the others ``{}``."""
        self._gather_groups()
        params = dict(self.named_parameters(remove_duplicate=False))
        mine: dict = {}
        lead = self.local_rank == 0
        for q in self.plan.params:
            p = params.get(q.name)
            if p is None or p not in optimizer.state:
                continue
            entry = {}
            for k, v in sorted(optimizer.state[p].items()):
                if isinstance(v, torch.Tensor) and v.dim() and tuple(v.shape) == tuple(p.shape):
                    v = q.trim(_gather_block(self, v.detach(), q.spec, q.global_shape))
                entry[k] = v.detach().clone().cpu() if isinstance(v, torch.Tensor) else v
            if lead:
                mine[q.name] = entry
        return self._collect(mine, rank0_only)

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        """Set ``optimizer``'s state for this rank's tensors from a dense one
        (:meth:`full_optimizer_state`, saved at any pp; no collective): each tensor
        sliced to this rank's block through the plan."""
        params = dict(self.named_parameters(remove_duplicate=False))
        for q in self.plan.params:
            p = params.get(q.name)
            src = state.get(q.name) or next((state[a] for a in q.aliases if a in state), None)
            if p is None or src is None:
                continue
            entry = {}
            for k, v in src.items():
                if isinstance(v, torch.Tensor) and v.dim() and tuple(v.shape) == q.hf_shape:
                    v = q.spec.local(q.pad(v), self.mesh, self.local_rank).clone()
                entry[k] = v.to(self.device) if isinstance(v, torch.Tensor) and v.dim() else v
            optimizer.state[p] = entry

    def _gather_groups(self) -> None:
        """Make every group a tensor's gather runs over (every rank, every group, in one
        order: later each rank gathers only its stages' tensors)."""
        mesh = self.mesh
        for axes in sorted({_spec_axes(q.spec, mesh) for q in self.plan.params if q.spec.axes},
                           key=lambda a: (len(a), [mesh.axes.index(x) for x in a])):
            self.group_name(axes)

    def _collect(self, mine: dict, rank0_only: bool) -> dict:
        """Every rank's ``mine`` merged on rank 0 (every rank with ``rank0_only=False``)."""
        gathered = [None] * dist.get_world_size() if (self.rank == 0 or not rank0_only) else None
        if rank0_only:
            dist.gather_object(mine, gathered, dst=0)
        else:
            dist.all_gather_object(gathered, mine)
        out: dict = {}
        for d in gathered or ():
            for k, v in (d or {}).items():
                out.setdefault(k, v)
        return out

    def save_checkpoint(self, path, optimizer=None, *, config=None) -> None:
        """Each rank writes its stages' blocks (and ``optimizer``'s state) to ``path``: a
        checkpoint that loads at another pp (:mod:`autoshard.io.pipeline_checkpoint`). Collective."""
        from .io.pipeline_checkpoint import save_pipeline_checkpoint

        save_pipeline_checkpoint(self, path, optimizer, config=config)

    def save_pretrained(self, path, *, config=None, max_shard_size="5GB") -> None:
        """A Hugging Face folder (``config.json`` + safetensors) of the dense model, gathered
        stage by stage; rank 0 writes it (collective). Loads with transformers'
        ``from_pretrained`` and shards again at any ``pp``."""
        from .io.builder import with_architecture
        from .io.gather import write_folder

        config = config if config is not None else self.config
        if config is None:
            raise ConfigError("save_pretrained needs the model's config: pass config=model.config")
        sd = self.full_state_dict()
        if self.rank == 0:
            entries = [(k, tuple(v.shape), v.dtype) for k, v in sd.items()]
            write_folder(path, entries, iter(sd.items()), with_architecture(config, self.plan.model),
                         max_shard_size=max_shard_size)
        dist.barrier()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a dense (full) state dict: each rank keeps its stages' tensors, sliced to
        its block through the plan (no collective). Tensors of other stages are skipped."""
        plans = {n: q for q in self.plan.params for n in (q.name, *q.aliases)}
        own = dict(self.named_parameters(remove_duplicate=False)) | dict(self.named_buffers(remove_duplicate=False))
        local = {}
        for k, v in state_dict.items():
            if k not in own:
                continue
            q = plans.get(k)
            if q is not None and isinstance(v, torch.Tensor):
                if tuple(v.shape) == q.hf_shape and q.pad_dim is not None:
                    v = q.pad(v.detach())
                if tuple(v.shape) == tuple(q.global_shape):
                    v = q.spec.local(v.detach(), self.mesh, self.local_rank)
            local[k] = v
        missing = [k for k in own if k not in local and (k in self._state_keys or k in plans)]
        if strict and missing:
            raise ConfigError(f"load_state_dict: {len(missing)} of this rank's tensors are missing: {missing[:4]}")
        return super().load_state_dict(local, strict=False, assign=assign)

    def __repr__(self) -> str:
        return (f"PipelinedModule({self.plan.model}, mode={self.plan.mode}, pp={self.pp}, schedule={self.schedule}, "
                f"stages={list(self.stage_indices)}, mesh={self.full_mesh}, rank={self.rank})")

    def estimate(self, micro_batches: int | None = None, cluster=None):
        """The cost model's price of a step of ``micro_batches`` (default: ``pp``) at the
        planned micro-batch: :class:`~autoshard.planning.pipeline_cost.PipelineEstimate`
        (step time, bubble, point-to-point bytes)."""
        return estimate_stages(self.stages, self.schedule, self.full_mesh, micro_batches or self.pp, cluster)

    def describe_stages(self, micro_batches: int | None = None, cluster=None) -> str:
        """The stages as a table (blocks, parameter and activation bytes per rank, time per
        stage, bytes received) and the schedule's bubble at ``micro_batches`` (default: ``pp``)."""
        return describe_stages(self.stages, self.schedule, self.full_mesh, micro_batches or self.pp, cluster)


def _gather_block(module: PipelinedModule, local: torch.Tensor, spec, shape) -> torch.Tensor:
    """The whole tensor of a stage's block from every rank's slice (all-gather over the
    spec's axes of the stage's mesh)."""
    from torch.distributed import distributed_c10d as c10d

    if not spec.axes:
        return local
    mesh, W = module.mesh, module.mesh.world_size
    pg = c10d._resolve_process_group(module.group_name(_spec_axes(spec, mesh)))
    order = dist.get_process_group_ranks(pg)
    lst = [torch.empty_like(local.contiguous()) for _ in order]
    dist.all_gather(lst, local.contiguous(), group=pg)
    out = torch.empty(tuple(shape), dtype=local.dtype, device=local.device)
    for r, blk in zip(order, lst):
        spec.place(out, blk, mesh, r % W)
    return out


def _spec_axes(spec, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes ``spec`` splits over, in the mesh's order (what its gather runs over)."""
    return tuple(a for a in mesh.axes if a in spec.axes)


def _send_tensors(ts: tuple, dst: int, group: str) -> None:
    """Point-to-point: the tensors' shapes and dtypes, then the tensors (counted by the ledger)."""
    meta = [(tuple(t.shape), t.dtype) for t in ts]
    dist.send_object_list([meta], dst=dst, group=C.process_group(group))
    for t in ts:
        C.send(t, dst, group)


def _recv_tensors(src: int, group: str, device) -> tuple:
    obj = [None]
    dist.recv_object_list(obj, src=src, group=C.process_group(group))
    out = []
    for shape, dtype in obj[0]:
        t = torch.empty(shape, dtype=dtype, device=device)
        C.recv(t, src, group)
        out.append(t)
    return tuple(out)
