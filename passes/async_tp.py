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
(eager only). 1d-sp's all-gather of the sequence before its column-parallel Linears is
pipelined too: where only Linears read it, the gather and those Linears become one
:func:`~autoshard.runtime.parallel_ops.gathered_linears` call whose chunks of the batch
are gathered while the chunk before multiplies. Whether it pays is the host's:
``benchmarks/bench_async_tp.py`` times the primitive, :func:`autoshard.planning.cost.estimate`
(``async_tp=``) predicts it.
"""

from __future__ import annotations

import copy
import operator

import torch
from torch import fx

from autoshard.runtime import parallel_ops

__all__ = ["async_row_linears"]


def async_row_linears(gm: fx.GraphModule, chunks: int) -> tuple[fx.GraphModule, int]:
    """A graph module running ``gm``'s graph with every row-parallel Linear (all-reducing,
    or reduce-scattering in 1d-sp) cut into ``chunks`` row blocks and every 1d-sp gather
    read only by Linears fused with them over ``chunks`` chunks of the batch (sharing
    ``gm``'s parameters and submodules), and how many row Linears and gathers were changed.

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
    # positions in the graph as it was: fusing inserts nodes but keeps the others' order
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(order):
        if node.op == "call_function" and node.target is parallel_ops.row_linear:
            node.kwargs = {**node.kwargs, "chunks": chunks}
            count += 1
        elif _gather_read_by_linears(node, order):
            _fuse_gather(graph, node, chunks, order)
            count += 1
    graph.lint()
    return fx.GraphModule(gm, graph), count


def _gather_read_by_linears(node: fx.Node, order: dict) -> bool:
    """Whether ``node`` is 1d-sp's all-gather of the sequence (one ``gather_partial``
    step, one segment) read only by Linears (``aten.linear``, as their input) whose
    weights and biases are defined before the first of them (``order``: the nodes'
    positions)."""
    if node.op != "call_function" or node.target is not parallel_ops.step or len(node.args) != 6:
        return False
    _, op, _, _, segments, factor = node.args
    users = list(node.users)
    if op != "gather_partial" or segments != 1 or factor is not None or not users:
        return False
    if not all(u.op == "call_function" and u.target is torch.ops.aten.linear.default and u.args[0] is node
               and node not in u.args[1:] and not u.kwargs for u in users):
        return False
    first = min(order[u] for u in users)
    return all(order[a] < first for u in users for a in u.args[1:] if isinstance(a, fx.Node))


def _fuse_gather(graph: fx.Graph, node: fx.Node, chunks: int, order: dict) -> None:
    """Replace the gather ``node`` and its Linears by one
    :func:`~autoshard.runtime.parallel_ops.gathered_linears` call and one item per Linear."""
    x, _, group, dim, _, _ = node.args
    users = sorted(node.users, key=order.__getitem__)
    weights = tuple(u.args[1] for u in users)
    biases = tuple(u.args[2] if len(u.args) > 2 else None for u in users)
    with graph.inserting_before(users[0]):
        fused = graph.call_function(parallel_ops.gathered_linears, (x, weights, biases),
                                    {"group": group, "dim": dim, "chunks": chunks})
        items = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(users))]
    for u, item in zip(users, items):
        item.meta = dict(u.meta)
        u.replace_all_uses_with(item)
        graph.erase_node(u)
    graph.erase_node(node)
