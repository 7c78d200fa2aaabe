"""One optimizer step of a pipeline-parallel module (:mod:`autoshard.pipeline_parallel`)
through torch's own engine: a ``torch.distributed.pipelining.PipelineStage`` per stage this
rank runs and the module's schedule (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``) over the micro-batches.

The last stage's loss is the model's own (its graph's output, vocabulary-parallel where
the plan splits it); each micro-batch's gradient is scaled by the micro-batch count, as
the dense :func:`autoshard.training.train.train_step` scales its accumulated ones, so the
step equals the dense step on the same micro-batches. After the schedule: the tied
tensors' gradients are summed over the pipeline ranks that read them, the global norm is
taken over every stage (clipping), and the step's loss (the micro-batches' mean) reaches
every rank. :func:`autoshard.training.train.train_step` calls :func:`pipeline_train_step`
for such a module::

    loss, norm = autoshard.training.train.train_step(sharded, micro_batches, optimizer, clip=1.0)
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..ir.errors import ConfigError
from ..ir.signature import main_input
from ..sharded.grads import replicas
from ..pipeline_parallel import SCHEDULES
from ..runtime import collectives as C

__all__ = ["pipeline_train_step", "pipeline_grad_norm", "pipeline_schedule"]


def pipeline_schedule(module, n_micro: int, key=()):
    """The schedule object (with its ``PipelineStage`` per stage of this rank) for
    ``n_micro`` micro-batches of the shapes ``key`` names; made once per key."""
    from torch.distributed import pipelining

    cache = module.schedule_cache
    if (n_micro, key) in cache:
        return cache[(n_micro, key)]
    cls_name, per_rank = SCHEDULES[module.schedule]
    if n_micro < module.pp and module.schedule != "gpipe":
        raise ConfigError(f"schedule {module.schedule!r} on pp={module.pp} needs at least {module.pp} micro-batches, "
                          f"got {n_micro}; valid: pass >= {module.pp} micro-batches, or schedule='gpipe'")
    pg = module.pp_group()
    n_stages = len(module.owners)
    stage_cls = counted_stage_class()
    label = module.group_name(("pp",))
    stages = [stage_cls(module.runner(i), i, n_stages, module.device, group=pg, ledger_group=label)
              for i in module.stage_indices]
    idx = module.loss_index()

    def loss_fn(outputs, target):     # the model's own loss: an output of the last stage's graph
        return outputs[idx]
    cls = getattr(pipelining, cls_name)
    sched = cls(stages[0] if per_rank == 1 else stages, n_microbatches=n_micro, loss_fn=loss_fn, scale_grads=False)
    cache.clear()           # one shape at a time: a stage keeps its buffers for the last one
    cache[(n_micro, key)] = sched
    return sched


_COUNTED: list = []


def counted_stage_class():
    """``torch.distributed.pipelining.PipelineStage`` whose point-to-point operations are
    recorded in the ledger (:func:`autoshard.runtime.collectives.count_p2p`) as torch's
    schedules take them: the four methods a schedule asks for each micro-batch's sends and
    receives (activations forward, their gradients back) return the ops it then runs, so
    counting there counts exactly what crosses each cut, with the tensors' real sizes. A
    cut between two stages of one rank (ZBV's V) has no op, and none is counted. What
    torch sends once per micro-batch shape to set a schedule up (its shape inference and
    warm-up vote: pickled objects and one-element tensors, through its private protocol)
    is not counted."""
    if _COUNTED:
        return _COUNTED[0]
    from torch.distributed.pipelining import PipelineStage

    class CountedStage(PipelineStage):
        def __init__(self, *args, ledger_group: str, **kwargs):
            super().__init__(*args, **kwargs)
            self.ledger_group = ledger_group

        def get_fwd_send_ops(self, fwd_chunk_id):
            return C.count_p2p(super().get_fwd_send_ops(fwd_chunk_id), self.ledger_group)

        def get_fwd_recv_ops(self, fwd_chunk_id):
            return C.count_p2p(super().get_fwd_recv_ops(fwd_chunk_id), self.ledger_group)

        def get_bwd_send_ops(self, bwd_chunk_id):
            return C.count_p2p(super().get_bwd_send_ops(bwd_chunk_id), self.ledger_group)

        def get_bwd_recv_ops(self, bwd_chunk_id):
            return C.count_p2p(super().get_bwd_recv_ops(bwd_chunk_id), self.ledger_group)

    _COUNTED.append(CountedStage)
    return CountedStage


def _unique(module):
    seen = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p


def pipeline_grad_norm(module) -> torch.Tensor:
    """The global L2 norm of the gradients over every stage (collective): each dense entry
    counted once (a replica's copies divided out, a tied tensor's pipeline copies too)."""
    plans = {n: q for q in module.plan.params for n in (q.name, *q.aliases)}
    ties = {id(p): group for p, group in module.tie_groups}
    total = torch.zeros((), dtype=torch.float64, device=module.device)
    for name, p in _unique(module):
        if p.grad is None or name not in plans:
            continue
        copies = replicas(plans[name], module.mesh)
        if id(p) in ties:
            from ..runtime.collectives import group_rank_size

            copies *= group_rank_size(ties[id(p)])[1]
        total += p.grad.detach().double().pow(2).sum() / copies
    return C.all_reduce(total, dist.group.WORLD.group_name, "sum").sqrt()


def pipeline_train_step(module, micro_batches: list[dict], optimizer, scheduler=None, *, clip: float | None = None,
                        dtype: torch.dtype | None = None) -> tuple[float, float | None]:
    """One optimizer step over ``micro_batches`` through the pipeline schedule (see the
    module doc). Returns (loss, grad norm before clipping or None), the same on every rank."""
    if not micro_batches:
        raise ConfigError("train_step: no micro-batches")
    mbs = [module.batch_inputs(mb) for mb in micro_batches]
    shapes = [tuple((k, tuple(v.shape)) for k, v in sorted(mb.items()) if isinstance(v, torch.Tensor)) for mb in mbs]
    if len(set(shapes)) > 1:
        raise ConfigError(f"a pipeline schedule runs micro-batches of one shape; got {sorted(set(shapes))[:2]} ...: "
                          f"pad them to one length")
    n = len(mbs)
    sched = pipeline_schedule(module, n, shapes[0])
    full = {k: torch.cat([mb[k] for mb in mbs]) if isinstance(mbs[0][k], torch.Tensor) else mbs[0][k]
            for k in mbs[0]}
    optimizer.zero_grad(set_to_none=True)
    losses: list = []
    args = (full[main_input(full)],) if 0 in module.stage_indices else ()
    target = torch.zeros(n, device=module.device)
    ctx = torch.autocast(module.device.type, dtype=dtype) if dtype not in (None, torch.float32) \
        else contextlib.nullcontext()
    with ctx:
        sched.step(*args, target=target, losses=losses, return_outputs=False, **full)
    for _, p in _unique(module):            # each micro-batch's loss counts 1/n, as the dense accumulation
        if p.grad is not None:
            p.grad.div_(n)
    module.sum_tied_grads()
    last = len(module.owners) - 1
    loss = torch.zeros((), dtype=torch.float32, device=module.device)
    if last in module.stage_indices:
        for part in losses:
            loss += part.detach().float() / n
    # from the last stage's rank to its pipeline: a sum with the others' zeros (exact), counted
    loss = C.all_reduce(loss, module.group_name(("pp",)), "sum")
    norm = None
    if clip is not None:
        total = pipeline_grad_norm(module)
        coef = (float(clip) / (total + 1e-6)).clamp(max=1.0)
        for _, p in _unique(module):
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
        norm = float(total)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return float(loss), norm
