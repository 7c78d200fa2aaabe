"""Pipeline parallelism's plan, made without processes: the stages a graph is cut into,
balanced on the cost model's time per block, their table and the schedule's priced bubble.

What :func:`autoshard.plan` returns with ``pp > 1`` (:func:`plan_pipeline`), and what
:func:`autoshard.pipeline_parallel.shard_pipelined` cuts a rank's graph by (the same
:func:`block_costs`, :func:`block_memory` and :func:`stage_infos`). See docs/design.md,
"Pipeline parallelism".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .ir.errors import ConfigError
from .ir.mesh import Mesh
from .ir.plan import ShardingPlan
from .passes.stages import Stage, balance, blocks_in_order, cut
from .planning.validate import Problem, raise_problems

__all__ = ["SCHEDULES", "PipelinePlan", "StageInfo", "block_costs", "block_memory", "bubble", "check_pipeline",
           "describe_stages", "estimate_stages", "plan_pipeline", "stage_infos", "stage_ranks"]

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
    from .config import ShardConfig
    from .io.builder import model_from
    from .launch.pipeline import PIPELINE, LaunchState

    schedule = schedule or "1f1b"
    model = model_from(model_or_config)
    config = getattr(model, "config", None)
    raise_problems(check_pipeline(pp=pp, schedule=schedule, world=world_size, mode=mode, config=config),
                   f"autoshard.plan(mode={mode!r}, pp={pp}, schedule={schedule!r})")
    cfg = ShardConfig.of(entry="plan", mode=mode, depth=depth, dp=dp, pp=pp, schedule=schedule, dropout=dropout,
                         cluster=cluster)
    model.train()
    state = PIPELINE.run(LaunchState(config=cfg, model=model, example_inputs=example_inputs,
                                     world_size=world_size // pp, capture_with="for_plan",
                                     policy=cfg.policy(world_size // pp), batch_size=batch_size, seq_len=seq_len),
                         "capture", "prepare", "plan")
    cap, p = state.prepared, state.plan
    mesh = Mesh(axes=("pp",) + p.mesh.axes, sizes=(pp,) + p.mesh.sizes)
    owners = stage_ranks(schedule, pp)
    keys = blocks_in_order(cap.module.graph)
    costs, head, tail = block_costs(p, keys, cluster)
    if len(keys) < len(owners):
        raise ConfigError(f"pp={pp} with schedule={schedule!r} needs {len(owners)} stages of whole transformer "
                          f"blocks; the graph has {len(keys)}: use a smaller pp")
    starts = balance(costs, len(owners), head, tail, **block_memory(p, keys, pp, cluster))
    stages = cut(cap.module, [keys[i] for i in starts[1:]])
    infos = stage_infos(p, stages, owners, keys, starts, costs, head, tail)
    m = micro_batches or pp
    return PipelinePlan(plan=p, mesh=mesh, schedule=schedule, micro_batches=m, stages=infos,
                        estimate=estimate_stages(infos, schedule, mesh, m, cluster), cluster=cluster)


def _block_of(module: str, keys: list[str]) -> str | None:
    for k in keys:
        if module == k or module.startswith(k + "."):
            return k
    return None


def block_memory(p: ShardingPlan, keys: list[str], in_flight: int, cluster=None) -> dict:
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


def block_costs(p: ShardingPlan, keys: list[str], cluster=None) -> tuple[list[float], float, float]:
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


def stage_infos(p: ShardingPlan, stages: list[Stage], owners, keys, starts, costs, head, tail) -> tuple:
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
