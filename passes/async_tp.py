"""Asynchronous (micro-pipelined) tensor parallelism for the row-parallel Linears of
1d and 1d-sp.

A row-parallel Linear (attention output, MLP down projection) multiplies its local
features and all-reduces the partial product before anything can use it. Cut into
``chunks`` row blocks, each block's all-reduce is launched as soon as the block is
multiplied and travels while the next block multiplies
(:func:`autoshard.runtime.parallel_ops.row_linear` with ``chunks``); the last block's
all-reduce is the only one left in the open. In 1d-sp the product is reduce-scattered
on the sequence dim instead; its chunks are chunks of the batch (dim 0), each
reduce-scattered alike. Exact: every row is the same product and the same sum (within
the collective's own summation order). The plan is not changed: the ledger counts
``chunks`` calls per row-parallel Linear, with the plan's bytes in all.

Applied to the rewritten graph by :meth:`autoshard.module.ShardedModule.async_tp`
(eager only). 1d-sp's all-gathers before its column-parallel Linears are left as they
are. Whether it pays is the host's: ``benchmarks/bench_async_tp.py`` times the primitive,
:func:`autoshard.planning.cost.estimate` (``async_tp=``) predicts it.
"""

from __future__ import annotations

import copy

from torch import fx

from autoshard.runtime import parallel_ops

__all__ = ["async_row_linears"]


def async_row_linears(gm: fx.GraphModule, chunks: int) -> tuple[fx.GraphModule, int]:
    """A graph module running ``gm``'s graph with every row-parallel Linear (all-reducing,
    or reduce-scattering in 1d-sp) cut into ``chunks`` row blocks (sharing ``gm``'s parameters and
    submodules), and how many Linears were changed.

    >>> import torch
    >>> g = fx.Graph()
    >>> x, w = g.placeholder("x"), g.placeholder("w")
    >>> y = g.call_function(parallel_ops.row_linear, (x, w, None), {"group": "tp", "n_dim": 0})
    >>> _ = g.output(y)
    >>> new, n = async_row_linears(fx.GraphModule(torch.nn.Module(), g), 2)
    >>> n, [nd.kwargs["chunks"] for nd in new.graph.nodes if nd.op == "call_function"]
    (1, [2])
    """
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r}: a whole number >= 1 (1: off)")
    graph = copy.deepcopy(gm.graph)
    count = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is parallel_ops.row_linear:
            node.kwargs = {**node.kwargs, "chunks": chunks}
            count += 1
    graph.lint()
    return fx.GraphModule(gm, graph), count
