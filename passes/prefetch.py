"""Weight prefetch on a rewritten graph: each SUMMA / 3D Linear's weight all-gather is
launched just before the Linear ahead of it runs, so the weight travels while that one
computes (issue 22's "launch the next gather while the current matmul runs").

The weights of a SUMMA (2d, 2.5d) or 3D Linear do not depend on the activations:
their gather can start at any point. :func:`prefetch_weights` finds the Linears in
graph order (calls of :func:`autoshard.runtime.parallel_ops.summa` / ``three_d`` whose weight
is a parameter read by ``get_attr``), inserts before Linear ``i-1`` a
:func:`~autoshard.runtime.parallel_ops.gather_weight_start` of Linear ``i``'s weight, and hands
Linear ``i`` the gathering (``ready=``), which it waits for in place of gathering the
weight itself. The same collectives, bytes and arithmetic: only when the weight's
gather is issued moves, the same on every rank (every rank runs the same graph), so
the order of the collectives on each process group is still the same everywhere. At
most two gathered weights are alive at once (the one in use and the next).

Eager only: the gathering is a Python object passed between nodes, which
``torch.compile`` does not trace; :meth:`autoshard.ShardedModule.compile` runs the
graphs without it.

Example::

    from autoshard.passes.prefetch import prefetch_weights
    gm2, n = prefetch_weights(gm)      # gm: a rewritten 2d / 2.5d / 3d graph module
"""

from __future__ import annotations

import copy

from torch import fx

from autoshard.runtime import parallel_ops

__all__ = ["prefetch_weights"]


def _weight_gather(node: fx.Node) -> tuple | None:
    """``(dim, group, segments)`` of the weight gather of a SUMMA / 3D Linear call whose
    weight is a parameter, else None."""
    w = node.args[1] if len(node.args) > 1 else None
    if not (isinstance(w, fx.Node) and w.op == "get_attr") or node.kwargs.get("ready") is not None:
        return None
    if node.target is parallel_ops.summa and node.kwargs.get("offs") is None:
        return node.kwargs["k_dim"], node.kwargs["row"], 1
    if node.target is parallel_ops.three_d:
        return node.kwargs["n_dim"], node.kwargs["a"], node.kwargs.get("segments", 1)
    return None


def prefetch_weights(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A graph module running ``gm``'s graph with every SUMMA / 3D Linear's weight gather
    launched one Linear early (sharing ``gm``'s parameters and submodules), and how many
    gathers were moved (0: no such Linear, the copy runs as ``gm``)."""
    graph = copy.deepcopy(gm.graph)
    linears = [(n, g) for n in graph.nodes if n.op == "call_function" and (g := _weight_gather(n)) is not None]
    for (ahead, _), (node, (dim, group, segments)) in zip(linears, linears[1:]):
        with graph.inserting_before(ahead):
            w = graph.get_attr(node.args[1].target)
            ready = graph.call_function(parallel_ops.gather_weight_start, (w, dim, group, segments))
        node.kwargs = {**node.kwargs, "ready": ready}
    graph.lint()
    return fx.GraphModule(gm, graph), max(len(linears) - 1, 0)
