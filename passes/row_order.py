"""Row-order analysis: which tensors hold their rows in a rank-local order.

With the batch split, every rank runs the graph on its own rows (tokens). Most
ops treat rows one by one, so a rank's rows are a block of the dense tensor's.
Mixture-of-experts routing does not: it *sorts* the rows by expert, runs each
expert on its group, and un-sorts. Run on a rank's own tokens that is exact, but
the tensors in between are a rank-local permutation of the rank's rows, not a
block of the dense ones, and the sort's indices are positions among the rank's
own rows. This pass tracks, from the graph alone (ATen ops and shapes), for
each tensor whose leading dim is rows:

* ``order``: ``None`` when its rows are a block of the dense tensor's, else the
  name of the sort that permuted them (``CONFLICT`` when rows of different orders
  met, or an op of unknown row semantics read permuted rows);
* ``index_into``: for an integer tensor whose values are positions among the
  rank's rows of a dim of ``length`` rows in order ``order`` (a sort's indices,
  an ``arange`` over the rows, ``positions // k`` for the rows before a
  ``[rows, k] -> [rows·k]`` flattening, an inverse permutation);
* ``perm``: those positions are a permutation (every row exactly once).

The rules then let a gather (``x[i]``) and a scatter (``y[i] = v``) on a
batch-split dim through when the index points into ``x``'s / ``y``'s own order
with the matching length (the result is the dense result's block, reordered as
the index says), and the pass refuses rows of a local order that meet rows of
another order. A ``histc`` of split rows counts the rank's rows: the partial sum
(over the batch axes) of the dense counts, which is what a grouped matmul over
the rank's sorted rows needs as its group sizes.

    >>> RowFact().order is None
    True
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from autoshard.ir.grouped import grouped_linear

aten = torch.ops.aten

__all__ = ["CONFLICT", "RowFact", "row_facts"]

CONFLICT = "<conflict>"


@dataclass(frozen=True)
class RowFact:
    """What :func:`row_facts` knows of one tensor's rows (see the module doc)."""

    order: str | None = None
    index_into: tuple | None = None          # (order, length in probe units)
    perm: bool = False
    identity: bool = False                   # values[j] == j (an arange over the rows)
    local_gather: bool = False               # an index op whose index points into its input's rows
    local_scatter: bool = False              # an index_put whose permutation covers its rows


_NATURAL = RowFact()

# ops that treat rows one by one (or do not touch dim 0) and keep their order
_KEEP = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default, aten.alias.default,
         aten.detach.default, aten.contiguous.default, aten.lift_fresh_copy.default}
_DIM_ARG_OPS = {aten.unsqueeze.default, aten.squeeze.dim, aten.chunk.default, aten.split.Tensor,
                aten.split_with_sizes.default, aten.softmax.int, aten._softmax.default, aten.topk.default,
                aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.select.int, aten.slice.Tensor}
_ORDER_FREE = {aten.histc.default, aten.sym_size.int, aten._assert_tensor_metadata.default}
_INVARIANT = {aten.sum.default, aten.mean.default, aten.sum.dim_IntList, aten.mean.dim, aten.amax.default}
_LIKE = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default}


def _is_rows(shape, is_rows) -> bool:
    return bool(shape) and is_rows(shape[0])


def row_facts(gm: fx.GraphModule, probe, is_rows) -> dict[str, RowFact | tuple]:
    """Facts for the nodes that differ from the default (natural rows, no index):
    ``{name: RowFact}``, or a tuple of them for a multi-output node. ``probe(shape)``
    gives probe sizes, ``is_rows(size)`` says whether a leading size is rows."""
    facts: dict[str, RowFact | tuple] = {}

    def fact(a, i=None) -> RowFact:
        f = facts.get(a.name, _NATURAL) if isinstance(a, fx.Node) else _NATURAL
        if isinstance(f, tuple):
            return f[i] if i is not None and i < len(f) else _NATURAL
        return f

    def shape(a):
        v = a.meta.get("val") if isinstance(a, fx.Node) else None
        return probe(v.shape) if isinstance(v, torch.Tensor) else None

    def rows_inputs(node):
        out = []
        for a in node.all_input_nodes:
            sh = shape(a)
            if sh is not None and _is_rows(sh, is_rows):
                out.append(a)
        return out

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        t, args = node.target, node.args
        out_sh = shape(node)
        if t is operator.getitem:
            f = facts.get(args[0].name) if isinstance(args[0], fx.Node) else None
            if isinstance(f, tuple) and args[1] < len(f) and f[args[1]] != _NATURAL:
                facts[node.name] = f[args[1]]
            continue
        if t in _ORDER_FREE:
            continue
        if t in (aten.arange.default, aten.arange.start, aten.arange.start_step):
            start = 0 if t == aten.arange.default else args[0]
            step = args[2] if t == aten.arange.start_step else 1
            if out_sh and _is_rows(out_sh, is_rows) and start == 0 and step == 1:
                facts[node.name] = RowFact(index_into=(None, out_sh[0]), identity=True)
            continue
        if t in (aten.sort.default, aten.sort.stable):
            x = args[0]
            sh = shape(x)
            dim = node.kwargs.get("dim", args[1] if len(args) > 1 and t == aten.sort.default else -1)
            if sh and _is_rows(sh, is_rows) and dim % len(sh) == 0:
                fx_ = fact(x)
                if fx_.order == CONFLICT:
                    facts[node.name] = (RowFact(order=CONFLICT), RowFact(order=CONFLICT))
                else:
                    facts[node.name] = (RowFact(order=node.name, index_into=fx_.index_into),
                                        RowFact(order=node.name, index_into=(fx_.order, sh[0]), perm=True))
                continue
        if t in (aten.floor_divide.default, aten.div.Tensor_mode) and isinstance(args[0], fx.Node):
            k = args[1]
            mode_ok = t == aten.floor_divide.default or node.kwargs.get("rounding_mode") == "floor"
            f = fact(args[0])
            if mode_ok and isinstance(k, int) and k > 0 and f.index_into and f.index_into[0] is None \
                    and f.index_into[1] % k == 0:
                facts[node.name] = RowFact(order=f.order, index_into=(None, f.index_into[1] // k))
                continue
        if t == aten.index.Tensor:
            x, idx = args
            taken = [d for d, i in enumerate(idx) if i is not None]
            xs = shape(x)
            if taken == [0] and xs and _is_rows(xs, is_rows):
                fi, fxx = fact(idx[0]), fact(x)
                if fi.index_into == (fxx.order, xs[0]) and fxx.order != CONFLICT and fi.order != CONFLICT:
                    facts[node.name] = RowFact(order=fi.order, index_into=fxx.index_into, local_gather=True)
                    continue
        if t in (aten.index_put_.default, aten.index_put.default):
            y, idx, v = args[:3]
            acc = args[3] if len(args) > 3 else node.kwargs.get("accumulate", False)
            ys = shape(y)
            if len(idx) == 1 and idx[0] is not None and not acc and ys and _is_rows(ys, is_rows):
                fi, fv = fact(idx[0]), fact(v)
                vs = shape(v)
                if fi.perm and fi.index_into and fi.index_into[1] == ys[0] and fi.order != CONFLICT \
                        and vs and vs[0] == ys[0]:
                    if fv.identity:       # y[i[j]] = j: the inverse permutation
                        facts[node.name] = RowFact(order=fi.index_into[0], index_into=(fi.order, ys[0]), perm=True,
                                                   local_scatter=True)
                        continue
                    if fv.order == fi.order:     # y[i[j]] = v[j]: v's rows un-permuted
                        facts[node.name] = RowFact(order=fi.index_into[0], index_into=fv.index_into,
                                                   local_scatter=True)
                        continue
        ins = rows_inputs(node)
        orders = {fact(a).order for a in ins}
        if not orders or orders == {None}:
            if t in _LIKE or not out_sh or not _is_rows(out_sh, is_rows):
                continue
            # an op on natural rows: natural; index values pass through dtype casts only
            if t in _KEEP and ins and fact(ins[0]).index_into:
                facts[node.name] = fact(ins[0])
            continue
        if t in _LIKE:              # fresh contents: any order is as good as another
            continue
        order = next(iter(orders)) if len(orders) == 1 else CONFLICT
        known = (t in _KEEP or t is grouped_linear or t in (aten.linear.default, aten.mm.default)
                 or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags)
                 or (t in _DIM_ARG_OPS and _dim_arg(node) not in (0, None))
                 or (t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
                     and out_sh and shape(args[0])[0] == out_sh[0]))
        if not known:
            if t in _INVARIANT:            # a sum / mean / max over the rows: any order gives the same
                continue
            order = CONFLICT
        if isinstance(node.meta.get("val"), (list, tuple)):
            facts[node.name] = tuple(RowFact(order=order) for _ in node.meta["val"])
        else:
            keep = fact(ins[0]) if t in _KEEP and len(ins) == 1 else None
            facts[node.name] = keep if keep is not None else RowFact(order=order)
    return facts


def _dim_arg(node):
    t = node.target
    if t in (aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default):
        d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    elif t == aten.topk.default:
        d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    elif t in (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default):
        d = node.args[1] if len(node.args) > 1 else None
        if isinstance(d, (list, tuple)):
            return None if any(x % node.args[0].meta["val"].dim() == 0 for x in d) or not d else 1
    else:
        d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if d is None:
        return None
    nd = node.args[0].meta["val"].dim() if t != aten.unsqueeze.default else node.args[0].meta["val"].dim() + 1
    return d % max(nd, 1)
