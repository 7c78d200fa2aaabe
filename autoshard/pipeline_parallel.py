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

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .ir.errors import ConfigError
from .ir.kernels import Dropout
from .ir.mesh import Mesh
from .ir.plan import ShardingPlan
from .ir.signature import batch_of, seq_of
from .passes.stages import Stage, balance, blocks_in_order, checkpoint_stages, cut
from .planning.validate import Problem, check_dims, check_example_inputs, check_model, raise_problems
from .runtime import collectives as C
from .runtime import parallel_ops

__all__ = ["SCHEDULES", "PipelinePlan", "PipelinedModule", "StageInfo", "bubble", "check_pipeline", "describe_stages",
           "estimate_stages", "plan_pipeline", "shard_pipelined", "stage_ranks"]

# schedule name -> (torch.distributed.pipelining class, stages per rank)
SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
             "interleaved": ("ScheduleInterleaved1F1B", 2), "zbv": ("ScheduleZBVZeroBubble", 2)}


@dataclass(frozen=True)
class StageInfo:
    """What the plan shows of one stage: its blocks, its pipeline rank, its cost."""

    index: int
    pp_rank: int
    blocks: tuple[str, ...]
    param_bytes: int            # per rank of the stage (the stage's tensor-parallel blocks)
    activation_bytes: int       # saved for backward per rank, at the planned batch
    seconds: float              # forward + backward compute and collectives, at the planned batch
    carried_in: int             # tensors received from the stage before
    carried_bytes: int = 0      # their bytes per rank and micro-batch (at the planned batch)
    grad_bytes: int = 0         # the bytes of their gradients sent back (those that need one)
    grad_in: int = 0            # how many of them have a gradient sent back


def stage_ranks(schedule: str, pp: int) -> list[int]:
    """The pipeline rank holding each stage, in stage order: one stage per rank, or for the
    interleaved schedule stage ``s`` on rank ``s mod pp``, for ZBV the V (rank ``r`` holds
    stages ``r`` and ``2·pp - 1 - r``).

        >>> stage_ranks("interleaved", 2), stage_ranks("zbv", 2)
        ([0, 1, 0, 1], [0, 1, 1, 0])
    """
    v = SCHEDULES[schedule][1]
    if schedule == "zbv":
        return list(range(pp)) + list(reversed(range(pp)))
    return [s % pp for s in range(pp * v)]


def _layers(config) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        v = getattr(config, key, None) if config is not None else None
        if isinstance(v, int):
            return v
    return None


def check_pipeline(*, pp, schedule, world: int, mode: str, config=None, fsdp: bool = False,
                   activation_checkpointing: bool = False, weights=None, auto: bool = False) -> list[Problem]:
    """Every problem of a pipeline-parallel request, found without a collective (the same
    list on every rank). ``auto``: ``mode="auto"`` is accepted (:func:`shard_pipelined`
    searches each stage's layout; planning without processes does not)."""
    out: list[Problem] = []
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        return [Problem("pp", f"pp={pp!r}: the number of pipeline stages, a whole number >= 1")]
    if schedule not in SCHEDULES:
        out.append(Problem("schedule", f"schedule={schedule!r}; valid choices: "
                                       f"{', '.join(repr(s) for s in SCHEDULES)}"))
    if world % pp:
        out.append(Problem("pp", f"pp={pp} does not divide the {world} ranks: world = pp × dp × cp × tp"))
    if mode == "auto" and not auto:
        out.append(Problem("mode", "mode='auto' with pp > 1 is searched by shard() only; here name the mode: "
                                   "'1d', '1d-sp', '2d', '2.5d' or '3d'"))
    for flag, name in ((fsdp, "fsdp=True"), (weights is not None, "weights= (or a folder path)")):
        if flag:
            out.append(Problem("pp", f"{name} is not built with pp > 1 yet; valid: pp=1, or leave it out"))
    n = _layers(config)
    v = SCHEDULES.get(schedule, (None, 1))[1]
    if n is not None and n < pp * v:
        out.append(Problem("pp", f"pp={pp} with schedule={schedule!r} needs {pp * v} stages of whole transformer "
                                 f"blocks; the model has {n}: use pp <= {n // v}"))
    return out


def shard_pipelined(model: nn.Module, *, mode: str, pp: int, schedule: str | None, depth=None, dp: int = 1,
                    example_inputs: dict | None = None, gather_logits: bool = True, dropout: str = "sharded",
                    device=None, cp: int = 1, cp_attention: str = "ring", cp_order: str = "balanced",
                    cluster=None, ensure_dist=None, fsdp: bool = False, activation_checkpointing: bool = False,
                    weights=None, captured=None) -> "PipelinedModule":
    """:func:`autoshard.shard` with ``pp`` pipeline stages (see the module doc). Called by it."""
    from .launch.capture_share import capture_shared
    from .passes.pipeline import plan_captured, prepare
    from .passes.rewrite import rewrite
    from .policies import make_policy
    from .runtime.device import rank_device
    from .runtime.groups import check_same_rng, plan_groups

    schedule = schedule or "1f1b"
    if not isinstance(model, nn.Module):
        raise ConfigError(f"shard(..., pp={pp}) takes a torch.nn.Module; got {type(model).__name__} "
                          f"(a folder path is not built with pp > 1 yet: load the model, then shard it)")
    from .adapters import is_peft_model

    if is_peft_model(model):
        raise ConfigError(f"shard(peft model, pp={pp}): adapters are not built with pp > 1 yet; valid: pp=1, or "
                          f"merge the adapters first (model.merge_and_unload())")
    config = getattr(model, "config", None)
    world = int(os.environ.get("WORLD_SIZE", "0") or 0) if not dist.is_initialized() else dist.get_world_size()
    raise_problems(check_pipeline(pp=pp, schedule=schedule, world=world or pp, mode=mode, config=config, fsdp=fsdp,
                                  activation_checkpointing=activation_checkpointing, weights=weights, auto=True),
                   f"autoshard.shard(mode={mode!r}, pp={pp}, schedule={schedule!r})")
    if ensure_dist is not None:
        ensure_dist()
    world, rank = dist.get_world_size(), dist.get_rank()
    W = world // pp
    problems = check_pipeline(pp=pp, schedule=schedule, world=world, mode=mode, config=config, auto=True)
    pol = None
    if mode != "auto":
        try:
            pol = make_policy(mode, W, depth, dp, cp, cp_attention, cp_order)
        except ConfigError as e:
            problems.append(Problem("mesh", f"each of the {pp} stages has {W} ranks: {e}"))
    problems += check_model(model) + check_example_inputs(example_inputs, config=config)
    if pol is not None:
        problems += check_dims(config, pol)
    if cp > 1 and cp_attention == "auto":
        problems.append(Problem("cp_attention", "cp_attention='auto' is not built with pp > 1 yet; valid: 'ring' "
                                                "or 'gather'"))
    raise_problems(problems, f"autoshard.shard(mode={mode!r}, pp={pp}) on {world} ranks")
    device = torch.device(device) if device is not None else rank_device()
    cap = captured or capture_shared(model, example_inputs=example_inputs)
    if pol is None:         # mode="auto": the layout of each stage's W ranks, searched alike on every rank
        from .planning.cost import Cluster, default_cluster
        from .planning.search import search

        ex = cap.example_inputs
        pol = search(cap, world_size=W, batch_size=batch_of(ex) * dp, seq_len=seq_of(ex) or 1, depth=depth, dp=dp,
                     cp=cp, cp_attention=cp_attention, cp_order=cp_order,
                     cluster=Cluster.preset(cluster) if cluster is not None else default_cluster()
                     ).best.candidate.policy()
    cap = prepare(cap, pol)
    ex = cap.example_inputs
    b, s = batch_of(ex), seq_of(ex) or 1
    split = pol.batch_split()[0]
    if b % split:
        raise ConfigError(f"example batch {b} does not divide the batch split {split} of mode {mode!r}: "
                          f"with pp > 1 pass example_inputs whose batch is a multiple of {split}")
    frozen = frozenset(n for n, t in model.named_parameters(remove_duplicate=False) if not t.requires_grad)
    p = plan_captured(cap, pol, batch_size=b * pol.dp, seq_len=s, gather_outputs=gather_logits, dropout=dropout,
                      frozen=frozen)
    mesh = Mesh(axes=("pp",) + p.mesh.axes, sizes=(pp,) + p.mesh.sizes)
    local = rank % W
    groups = plan_groups(p, rank, mesh=mesh)
    if any(isinstance(n.kernel, Dropout) for n in p.nodes):
        check_same_rng(world, "the model has dropout", "replicas would drop different elements",
                       "before shard(), or shard(..., seed=s)")
    gm = rewrite(cap.module, p, rank=local, groups=groups)
    owners = stage_ranks(schedule, pp)
    keys = blocks_in_order(gm.graph)
    costs, head, tail = _block_costs(p, keys, cluster)
    if len(keys) < len(owners):
        raise ConfigError(f"pp={pp} with schedule={schedule!r} needs {len(owners)} stages of whole transformer "
                          f"blocks; the graph has {len(keys)} blocks ({', '.join(keys[:4])}): use a smaller pp")
    starts = balance(costs, len(owners), head, tail, **_block_memory(p, keys, pp, cluster))
    stages = cut(gm, [keys[i] for i in starts[1:]])
    infos = _stage_infos(p, stages, owners, keys, starts, costs, head, tail)
    if activation_checkpointing:        # after the infos: they read the stages' carried placeholders
        checkpoint_stages(stages)
    return PipelinedModule(stages, infos, p, mesh=mesh, rank=rank, groups=groups, schedule=schedule,
                           captured=cap, model=model, device=device)


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline-parallel layout planned without processes (:func:`plan_pipeline`): the
    mode's plan of one stage's block of ranks, the stages cut from the graph and the cost
    model's price of a step. ``str()`` is the stage table."""

    plan: ShardingPlan          # the mode's plan on world / pp ranks (every stage's layout)
    mesh: Mesh                  # the whole mesh, pp outermost
    schedule: str
    micro_batches: int
    stages: tuple               # StageInfo per stage
    estimate: object            # autoshard.planning.pipeline_cost.PipelineEstimate
    cluster: object = "dgx-a100"  # what the stages and the step are priced on

    def __str__(self) -> str:
        return describe_stages(self.stages, self.schedule, self.mesh, self.micro_batches, self.cluster)


def plan_pipeline(model_or_config, *, world_size: int, mode: str, pp: int, schedule: str | None = None,
                  depth: int | None = None, dp: int = 1, batch_size: int = 8, seq_len: int = 128,
                  micro_batches: int | None = None, cluster="dgx-a100", example_inputs: dict | None = None,
                  dropout: str = "sharded") -> PipelinePlan:
    """Plan ``pp`` pipeline stages without processes or weights (the model is built on
    the meta device): ``batch_size`` rows per micro-batch, ``micro_batches`` per step
    (default ``pp``). What :func:`autoshard.plan` returns with ``pp > 1``.

    Example (a capture: skipped by the fast doctest run, run by
    tests/test_pipeline_parallel.py::test_plan_with_pp_shows_the_stages_and_the_bubble):
        >>> from transformers import LlamaConfig
        >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
        >>> pl = plan_pipeline(cfg, world_size=4, mode="1d", pp=2, batch_size=4, seq_len=16)  # doctest: +SKIP
        >>> [s.blocks for s in pl.stages]  # doctest: +SKIP
        [('model.layers.0', 'model.layers.1'), ('model.layers.2', 'model.layers.3')]
    """
    from .io.builder import model_from
    from .launch.capture_share import capture_for_plan
    from .passes.pipeline import plan_captured, prepare
    from .policies import make_policy

    schedule = schedule or "1f1b"
    model = model_from(model_or_config)
    config = getattr(model, "config", None)
    raise_problems(check_pipeline(pp=pp, schedule=schedule, world=world_size, mode=mode, config=config),
                   f"autoshard.plan(mode={mode!r}, pp={pp}, schedule={schedule!r})")
    pol = make_policy(mode, world_size // pp, depth, dp)
    model.train()
    cap = prepare(capture_for_plan(model, example_inputs=example_inputs), pol)
    p = plan_captured(cap, pol, batch_size=batch_size, seq_len=seq_len, dropout=dropout)
    mesh = Mesh(axes=("pp",) + p.mesh.axes, sizes=(pp,) + p.mesh.sizes)
    owners = stage_ranks(schedule, pp)
    keys = blocks_in_order(cap.module.graph)
    costs, head, tail = _block_costs(p, keys, cluster)
    if len(keys) < len(owners):
        raise ConfigError(f"pp={pp} with schedule={schedule!r} needs {len(owners)} stages of whole transformer "
                          f"blocks; the graph has {len(keys)}: use a smaller pp")
    starts = balance(costs, len(owners), head, tail, **_block_memory(p, keys, pp, cluster))
    stages = cut(cap.module, [keys[i] for i in starts[1:]])
    infos = _stage_infos(p, stages, owners, keys, starts, costs, head, tail)
    m = micro_batches or pp
    return PipelinePlan(plan=p, mesh=mesh, schedule=schedule, micro_batches=m, stages=infos,
                        estimate=estimate_stages(infos, schedule, mesh, m, cluster), cluster=cluster)


def _block_of(module: str, keys: list[str]) -> str | None:
    for k in keys:
        if module == k or module.startswith(k + "."):
            return k
    return None


def _block_memory(p: ShardingPlan, keys: list[str], in_flight: int, cluster=None) -> dict:
    """What :func:`~autoshard.passes.stages.balance` bounds each stage's memory with: per
    block (and before the first, after the last) the bytes one rank holds, its parameters
    with their gradients and AdamW's two moments (the trainable ones) plus the tensors its
    nodes save for backward times the micro-batches in flight (``pp``, as in 1F1B's warm-up),
    against the cluster's memory per rank."""
    from .planning.cost import Cluster, default_cluster

    cl = Cluster.preset(cluster) if cluster is not None else default_cluster()
    per = {k: 0.0 for k in keys}
    ends = [0.0, 0.0]           # before the first block, after the last
    seen_block = False
    for n in p.nodes:
        k = _block_of(n.module, keys) if n.module else None
        seen_block = seen_block or k is not None
        saved = in_flight * sum(t.nbytes for t in (n.saved or ()))
        if k is not None:
            per[k] += saved
        else:
            ends[seen_block] += saved
    head_names, tail_names = _ends_params(p, keys)
    for q in p.params:
        nbytes = math.prod(q.local_shape(p.mesh)) * q.dtype_bytes * (4 if q.trainable else 1)
        k = _block_of(q.name.rpartition(".")[0], keys)
        if k is not None:
            per[k] += nbytes
        else:       # the embedding before the blocks, the head and the final norm after (a tied one on both)
            if q.name in head_names or q.name not in tail_names:
                ends[0] += nbytes
            if q.name in tail_names:
                ends[1] += nbytes
    return dict(memory=[per[k] for k in keys], mem_head=ends[0], mem_tail=ends[1], limit=float(cl.memory_bytes))


def _ends_params(p: ShardingPlan, keys: list[str]) -> tuple[set, set]:
    """The parameters outside the blocks read before the first block (head) and after the
    last (tail), from the plan rows' modules (a tied one is in both)."""
    head, tail = set(), set()
    seen_block = False
    for n in p.nodes:
        if n.module and _block_of(n.module, keys) is not None:
            seen_block = True
            continue
        for q in p.params:
            if n.module and q.name.rpartition(".")[0] == n.module:
                (tail if seen_block else head).add(q.name)
    return head, tail


def _block_costs(p: ShardingPlan, keys: list[str], cluster=None) -> tuple[list[float], float, float]:
    """Seconds per block (forward and backward compute at the cost model's rate, plus
    the collectives), and those of what runs before the first block (head) and after the
    last (tail): what :func:`~autoshard.passes.stages.balance` balances."""
    from .planning.cost import Cluster, collective_time, default_cluster, node_flops

    cl = Cluster.preset(cluster) if cluster is not None else default_cluster()
    params = {n: q for q in p.params for n in (q.name, *q.aliases)}
    per = {k: 0.0 for k in keys}
    head = tail = 0.0
    seen_block = False
    for n in p.nodes:
        f = node_flops(n, p, params)
        t = 3 * f / cl.rate(f) if f else 0.0          # forward + backward (2×)
        t += cl.op_overhead if n.kind not in ("input", "state") else 0.0
        t += sum(collective_time(c, p.mesh, cl)[0] for c in n.comms)
        k = _block_of(n.module, keys) if n.module else None
        if k is not None:
            per[k] += t
            seen_block = True
        elif seen_block:
            tail += t
        else:
            head += t
    return [per[k] for k in keys], head, tail


def _stage_infos(p: ShardingPlan, stages: list[Stage], owners, keys, starts, costs, head, tail) -> tuple:
    by_name = {n: q for q in p.params for n in (q.name, *q.aliases)}
    saved = {}
    for n in p.nodes:
        k = _block_of(n.module, keys) if n.module else None
        saved[k] = saved.get(k, 0) + sum(getattr(t, "nbytes", 0) or 0 for t in (n.saved or ()))
    out = []
    ends = list(starts[1:]) + [len(keys)]
    for st, lo, hi in zip(stages, starts, ends):
        names = {by_name[t].name for t in st.tensors if t in by_name}
        pbytes = sum(math.prod(q.local_shape(p.mesh)) * q.dtype_bytes for q in p.params if q.name in names)
        secs = sum(costs[lo:hi]) + (head if lo == 0 else 0.0) + (tail if hi == len(keys) else 0.0)
        acts = sum(saved.get(k, 0) for k in keys[lo:hi]) + (saved.get(None, 0) if lo == 0 or hi == len(keys) else 0)
        fwd = grad = 0
        for name, val in zip(st.carried_in, _carried_values(st)):
            nbytes = _local_bytes(p, name, val)
            fwd += nbytes
            grad += nbytes if name in st.grad_in else 0
        out.append(StageInfo(index=st.index, pp_rank=owners[st.index], blocks=tuple(keys[lo:hi]), param_bytes=pbytes,
                             activation_bytes=int(acts), seconds=secs, carried_in=len(st.carried_in),
                             carried_bytes=fwd, grad_bytes=grad, grad_in=len(st.grad_in)))
    return tuple(out)


def _carried_values(st: Stage) -> list:
    """The captured values (fake tensors) of the tensors stage ``st`` receives (None where unknown)."""
    phs = [n for n in st.gm.graph.nodes if n.op == "placeholder" and n.name.startswith("carried_")]
    vals = [n.meta.get("val") for n in phs]
    return [v if isinstance(v, torch.Tensor) else None for v in vals]


def _local_bytes(p: ShardingPlan, name: str, val) -> int:
    """Bytes of one rank's block of the value ``name`` at the planned batch: its plan row's
    local shape (the planned sizes), else the value's own shape where it is static."""
    row = next((n for n in p.nodes if n.name == name), None)
    size = val.element_size() if val is not None else 4
    if row is not None and row.local_shape and not isinstance(row.local_shape[0], tuple):
        return int(math.prod(row.local_shape)) * size
    try:
        return int(math.prod(int(d) for d in val.shape)) * size
    except (TypeError, ValueError, AttributeError):
        return 0


def bubble(schedule: str, pp: int, micro_batches: int) -> float:
    """The idle share of a step under ``schedule`` when every stage takes the same time:
    (p − 1)/(m + p − 1) for GPipe and 1F1B; the interleaved schedule divides the warm-up
    by its ``v`` stages per rank, (p − 1)/(v·m + p − 1); ZBV fills it with weight gradients
    (0 when forward, input-gradient and weight-gradient times are equal; the 1F1B figure
    with v = 2 is given as its bound).

        >>> round(bubble("1f1b", 4, 8), 3), round(bubble("interleaved", 4, 8), 3)
        (0.273, 0.158)
    """
    v = SCHEDULES[schedule][1]
    return (pp - 1) / (v * micro_batches + pp - 1)


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

    def save_checkpoint(self, path, optimizer=None, *, config=None) -> None:
        """The sharded checkpoint, each rank its stages' blocks (collective; see
        :mod:`autoshard.io.pipeline_checkpoint`, which also loads it at any pp)."""
        from .io.pipeline_checkpoint import save_pipeline_checkpoint

        save_pipeline_checkpoint(self, path, optimizer, config=config)

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


def estimate_stages(infos, schedule: str, mesh: Mesh, micro_batches: int, cluster=None):
    """:func:`autoshard.planning.pipeline_cost.estimate_pipeline` of these stages."""
    from .planning.cost import default_cluster
    from .planning.pipeline_cost import estimate_pipeline

    return estimate_pipeline([i.seconds for i in infos], [i.pp_rank for i in infos],
                             [i.carried_bytes for i in infos], grad_bytes=[i.grad_bytes for i in infos],
                             micro_batches=micro_batches, stages_per_rank=SCHEDULES[schedule][1], mesh=mesh,
                             cluster=cluster if cluster is not None else default_cluster())


def describe_stages(infos, schedule: str, mesh: Mesh, micro_batches: int, cluster=None) -> str:
    """A table of the stages and the bubble (see :meth:`PipelinedModule.describe_stages`)."""
    from .planning.cost import human_bytes

    pp = mesh.size("pp")
    est = estimate_stages(infos, schedule, mesh, micro_batches, cluster)
    rows = [f"pipeline: {len(infos)} stages on pp={pp}, schedule {schedule!r}, {micro_batches} micro-batches: "
            f"bubble {bubble(schedule, pp, micro_batches):.1%} with equal stages, {est.bubble:.1%} predicted; "
            f"step {est.step_s * 1e3:.2f} ms predicted; point-to-point {human_bytes(est.p2p_bytes)}/rank per step"]
    worst = max(i.seconds for i in infos) or 1.0
    for i in infos:
        span = f"{i.blocks[0]} .. {i.blocks[-1]}" if len(i.blocks) > 1 else i.blocks[0]
        rows.append(f"  stage {i.index} (pp rank {i.pp_rank}): {len(i.blocks)} block(s) {span}; params "
                    f"{human_bytes(i.param_bytes)}/rank, saved {human_bytes(i.activation_bytes)}/rank per micro-batch, "
                    f"{i.seconds * 1e3:.2f} ms ({i.seconds / worst:.0%} of the slowest); receives {i.carried_in} tensor(s), "
                    f"{human_bytes(i.carried_bytes)}/rank per micro-batch")
    return "\n".join(rows)


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
    from torch.distributed import distributed_c10d as c10d

    dist.send_object_list([meta], dst=dst, group=c10d._resolve_process_group(group))
    for t in ts:
        C.send(t, dst, group)


def _recv_tensors(src: int, group: str, device) -> tuple:
    from torch.distributed import distributed_c10d as c10d

    obj = [None]
    dist.recv_object_list(obj, src=src, group=c10d._resolve_process_group(group))
    out = []
    for shape, dtype in obj[0]:
        t = torch.empty(shape, dtype=dtype, device=device)
        C.recv(t, src, group)
        out.append(t)
    return tuple(out)
