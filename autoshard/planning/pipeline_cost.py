"""The cost model's price of a pipeline schedule: the bubble and the point-to-point bytes.

Each stage costs its forward + backward time per micro-batch (the blocks' compute and
collectives, :func:`autoshard.pipeline_parallel` sums them from the plan). A pipeline rank
running stages whose times per micro-batch add up to ``T_r`` (``v`` stages for the
interleaved and ZBV schedules) keeps busy ``m · T_r`` of a step of ``m`` micro-batches; the
step is as long as the slowest rank's work plus the fill and drain, ``p − 1`` of the
slowest stage's turns, plus the hops: every micro-batch's activations go forward and its
gradients back across each cut, ``bytes / bandwidth + latency`` on the link the ``pp`` axis
takes (across nodes where the mesh puts it there; a cut between two stages of one rank,
ZBV's V, hands its tensors over in memory and costs nothing), and torch's schedules wait
for each receive before they compute, so the hops are not hidden::

    step = m · max_r T_r + (p − 1) · max_s t_s + (m · v + p − 1) · 2 · t_hop

With equal stages and free hops the idle share is (p − 1)/(v·m + p − 1): GPipe's and
1F1B's (p − 1)/(m + p − 1), the interleaved schedule's smaller by its ``v``.

    >>> from autoshard.ir.mesh import Mesh
    >>> e = estimate_pipeline([1.0, 1.0], [0, 1], [0, 1 << 20], micro_batches=4, stages_per_rank=1,
    ...                       mesh=Mesh(axes=("pp",), sizes=(2,)), cluster="dgx-a100")
    >>> round(e.step_s, 3), round(e.bubble, 3), e.p2p_bytes       # 1 MiB each way per micro-batch
    (5.0, 0.2, 4194304)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.mesh import Mesh
from .cost import Cluster, link_of

__all__ = ["PipelineEstimate", "estimate_pipeline", "p2p_per_step"]


@dataclass(frozen=True)
class PipelineEstimate:
    """A pipeline step as the cost model predicts it."""

    micro_batches: int
    stages_per_rank: int
    rank_seconds: tuple[float, ...]     # per micro-batch work of each pipeline rank (its stages, fwd + bwd)
    hop_bytes: tuple[int, ...]          # per micro-batch, one direction, each cut (stage s -> s + 1)
    hop_seconds: float                  # the slowest cut's one-direction time per micro-batch
    p2p_bytes: int                      # bytes one rank sends per step (activations and gradients), the most
    step_s: float
    bubble: float                       # predicted idle share, the mean over pipeline ranks

    def idle_share(self, pp_rank: int) -> float:
        """The share of the step pipeline rank ``pp_rank`` waits."""
        return max(0.0, 1.0 - self.micro_batches * self.rank_seconds[pp_rank] / self.step_s) if self.step_s else 0.0


def estimate_pipeline(stage_seconds: list[float], stage_ranks: list[int], carried_bytes: list[int], *,
                      micro_batches: int, stages_per_rank: int, mesh: Mesh, cluster="dgx-a100",
                      grad_bytes: list[int] | None = None) -> PipelineEstimate:
    """Price a step (see the module doc). ``stage_seconds[s]``: stage ``s``'s forward +
    backward time per micro-batch; ``stage_ranks[s]``: its pipeline rank;
    ``carried_bytes[s]``: what stage ``s`` receives per micro-batch (0 for the first);
    ``grad_bytes[s]``: the gradients stage ``s`` sends back (its floating carried tensors';
    default ``carried_bytes``); ``mesh``: the whole mesh, ``pp`` outermost (where its hops run)."""
    grad_bytes = list(carried_bytes) if grad_bytes is None else list(grad_bytes)
    cl = Cluster.preset(cluster) if isinstance(cluster, str) else cluster
    pp = mesh.size("pp") if "pp" in mesh.axes else 1
    m, v = int(micro_batches), int(stages_per_rank)
    ranks = [0.0] * pp
    for t, r in zip(stage_seconds, stage_ranks):
        ranks[r] += t
    link, load = link_of(mesh, ("pp",), cl.ranks_per_node) if pp > 1 else ("intra", 0)
    bw = cl.intra_bw if link == "intra" else min(cl.intra_bw, cl.inter_bw / max(load, 1))
    lat = cl.intra_latency if link == "intra" else cl.inter_latency
    # a cut between two stages of one rank (ZBV's V) passes its tensors by reference: no hop
    hops = [int(b) if stage_ranks[s] != stage_ranks[s - 1] else 0 for s, b in enumerate(carried_bytes) if s]
    hop = max((lat + b / bw for b in hops if b), default=0.0)
    step = m * max(ranks) + (pp - 1) * max(stage_seconds) + (m * v + pp - 1) * 2 * hop if pp > 1 else m * ranks[0]
    sent = [0] * pp
    for s, b in enumerate(carried_bytes):
        if s and stage_ranks[s] != stage_ranks[s - 1]:
            sent[stage_ranks[s - 1]] += b * m          # activations forward
            sent[stage_ranks[s]] += grad_bytes[s] * m  # their gradients back
    est = PipelineEstimate(micro_batches=m, stages_per_rank=v, rank_seconds=tuple(ranks), hop_bytes=tuple(hops),
                           hop_seconds=hop, p2p_bytes=max(sent), step_s=step, bubble=0.0)
    share = sum(est.idle_share(r) for r in range(pp)) / pp
    return PipelineEstimate(**{**est.__dict__, "bubble": share})


def p2p_per_step(stages, micro_batches: int) -> dict[int, dict[str, tuple[int, int]]]:
    """The point-to-point calls and bytes each pipeline rank makes in one training step of
    ``micro_batches``, from the plan's stages (``StageInfo``: ``pp_rank``, ``carried_in``
    tensors of ``carried_bytes`` received per micro-batch, ``grad_in`` of them with
    ``grad_bytes`` of gradients sent back): ``{pp_rank: {"send": (calls, bytes), "recv":
    (calls, bytes)}}``, one call per tensor and micro-batch, as torch's schedules send
    them and the ledger counts them (``kind`` ``send`` / ``recv`` on the ``pp`` group). A
    cut between two stages of one rank sends nothing.

        >>> from types import SimpleNamespace as S
        >>> st = [S(pp_rank=0, carried_in=0, carried_bytes=0, grad_in=0, grad_bytes=0),
        ...       S(pp_rank=1, carried_in=3, carried_bytes=4096 + 1024, grad_in=1, grad_bytes=4096)]
        >>> p2p_per_step(st, 4)[0]        # rank 0 sends 3 tensors per micro-batch, gets 1 gradient back
        {'send': (12, 20480), 'recv': (4, 16384)}
    """
    m = int(micro_batches)
    ranks = {s.pp_rank for s in stages}
    out = {r: {"send": [0, 0], "recv": [0, 0]} for r in ranks}
    for prev, st in zip(stages, stages[1:]):
        a, b = prev.pp_rank, st.pp_rank
        if a == b:
            continue
        for r, fwd, bwd in ((a, "send", "recv"), (b, "recv", "send")):
            out[r][fwd][0] += st.carried_in * m
            out[r][fwd][1] += st.carried_bytes * m
            out[r][bwd][0] += st.grad_in * m
            out[r][bwd][1] += st.grad_bytes * m
    return {r: {k: tuple(v) for k, v in d.items()} for r, d in out.items()}
