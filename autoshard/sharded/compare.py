"""A sharded module against the dense model, node by node, on a real batch
(:mod:`autoshard.runtime.compare` does the comparing): what
:meth:`~autoshard.module.ShardedModule.compare` and
:meth:`~autoshard.module.ShardedModule.compare_values` run."""

from __future__ import annotations

import torch
from torch import nn

from ..ir.errors import ConfigError
from ..ir.signature import batch_of
from ..runtime import collectives as C
from ..runtime import parallel_ops
from ..runtime.device import on_device

__all__ = ["compare_values", "compare"]


def compare_values(sharded, dense_values: dict, batch: dict, *, atol: "float | dict" = 1e-5,
                   rtol: float = 1e-5) -> list:
    """This rank's :class:`~autoshard.runtime.compare.NodeDiff` rows for ``batch`` against
    the dense graph's node values (see :meth:`~autoshard.module.ShardedModule.compare_values`).
    Collective."""
    from ..runtime.compare import compare as compare_nodes

    kwargs = on_device({k: v for k, v in batch.items() if v is not None}, sharded.device)
    g, full = sharded.graph_for(kwargs)
    b = batch_of(full) or 0
    if sharded.batch_split > 1 and b % sharded.batch_split:
        raise ConfigError(f"compare: batch size {b} does not divide the batch split "
                          f"{sharded.batch_split}; use a multiple of {sharded.batch_split}")
    from ..passes.row_order import LOCAL_ROWS_NOTE
    from ..runtime.groups import axes_label

    local_rows = frozenset(n.name for n in g.plan.nodes if LOCAL_ROWS_NOTE in n.notes)

    def reduce(t, axes):        # a partial sum, summed over its axes (every rank reaches the same nodes)
        group = sharded.groups.get(axes_label(axes))
        return None if group is None else C.all_reduce(t.detach().clone(), group, "sum")

    with torch.no_grad(), parallel_ops.dropout_active(sharded.training):
        _, rows = compare_nodes(g.gm, sharded.mesh, full, dense_values, rank=sharded.rank, atol=atol, rtol=rtol,
                                reduce=reduce, local_rows=local_rows)
    return rows


def compare(sharded, dense_model: nn.Module, batch: dict, *, atol: float = 1e-5, rtol: float = 1e-5):
    """Each planned node of ``sharded`` against ``dense_model``'s on the global ``batch``,
    merged over every rank (see :meth:`~autoshard.module.ShardedModule.compare`).
    Collective: every rank calls it."""
    import torch.distributed as dist

    from ..launch.pipeline import PIPELINE, layout_state
    from ..policies import POLICIES
    from ..runtime.compare import Comparison, merge, record

    kwargs = {k: v for k, v in batch.items() if v is not None}
    prepared = PIPELINE.run(layout_state(POLICIES[sharded.plan.mode](sharded.plan.mesh), model=dense_model,
                                         example_inputs=kwargs), "capture", "prepare").prepared
    dev = next((p.device for p in dense_model.parameters()), torch.device("cpu"))
    with torch.no_grad():
        values = record(prepared.module, {k: v for k, v in {**on_device(kwargs, dev), **prepared.constants}.items()
                                          if k in prepared.input_names})
    local = kwargs
    if "dp" in sharded.mesh.axes:      # this replica's rows of the global batch
        b = batch_of(kwargs)
        per = b // sharded.mesh.size("dp")
        lo = sharded.coords["dp"] * per
        local = {k: v[lo:lo + per] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == b
                 else v for k, v in kwargs.items()}
    rows = compare_values(sharded, {k: v.to(sharded.device) if isinstance(v, torch.Tensor) else v
                                    for k, v in values.items()}, local, atol=atol, rtol=rtol)
    every = [None] * dist.get_world_size() if dist.is_initialized() else [rows]
    if dist.is_initialized():
        dist.all_gather_object(every, rows)
    kinds = {n.name: (n.kind, n.module or "") for n in sharded.plan.nodes}
    return Comparison(merge(every), kinds)
