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

__all__ = ["CONFLICT", "LOCAL_ROWS_NOTE", "RowFact", "row_facts"]

CONFLICT = "<conflict>"
# the plan note of a value whose rows are in a rank-local order (or index the rank's rows)
LOCAL_ROWS_NOTE = "local rows: in a rank-local order (sorted on the rank's own tokens), not a block of the dense value"


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
    rf = _RowFacts(probe, is_rows)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for rule in _RULES:
            f = rule(rf, node)
            if f is not None:
                if f is not _NOTHING:
                    rf.facts[node.name] = f
                break
    return rf.facts


#: a rule's answer for a node it settles with no fact to record (``None``: not its node)
_NOTHING = object()


class _RowFacts:
    """The facts gathered so far over one graph, and how it reads shapes and rows."""

    def __init__(self, probe, is_rows) -> None:
        self.facts: dict[str, RowFact | tuple] = {}
        self.probe, self.is_rows = probe, is_rows

    def fact(self, a, i=None) -> RowFact:
        """The fact of ``a`` (its ``i``-th output's for a multi-output node)."""
        f = self.facts.get(a.name, _NATURAL) if isinstance(a, fx.Node) else _NATURAL
        if isinstance(f, tuple):
            return f[i] if i is not None and i < len(f) else _NATURAL
        return f

    def shape(self, a):
        """``a``'s shape in probe sizes, or None where ``a`` is no tensor."""
        v = a.meta.get("val") if isinstance(a, fx.Node) else None
        return self.probe(v.shape) if isinstance(v, torch.Tensor) else None

    def rows(self, shape) -> bool:
        """Whether a tensor of ``shape`` (probe sizes) leads with rows."""
        return _is_rows(shape, self.is_rows)

    def rows_inputs(self, node) -> list:
        """``node``'s inputs that lead with rows."""
        out = []
        for a in node.all_input_nodes:
            sh = self.shape(a)
            if sh is not None and self.rows(sh):
                out.append(a)
        return out


def _getitem(rf: _RowFacts, node):
    """One output of a multi-output node takes that output's fact."""
    if node.target is not operator.getitem:
        return None
    src, i = node.args
    f = rf.facts.get(src.name) if isinstance(src, fx.Node) else None
    if isinstance(f, tuple) and i < len(f) and f[i] != _NATURAL:
        return f[i]
    return _NOTHING


def _order_free(rf: _RowFacts, node):
    """Ops whose result does not depend on the rows' order: no fact."""
    return _NOTHING if node.target in _ORDER_FREE else None


def _arange(rf: _RowFacts, node):
    """``arange`` over the rows from 0 by 1: the identity index into natural rows."""
    t, args = node.target, node.args
    if t not in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        return None
    start = 0 if t == aten.arange.default else args[0]
    step = args[2] if t == aten.arange.start_step else 1
    out_sh = rf.shape(node)
    if out_sh and rf.rows(out_sh) and start == 0 and step == 1:
        return RowFact(index_into=(None, out_sh[0]), identity=True)
    return _NOTHING


def _sort(rf: _RowFacts, node):
    """A sort over the rows: its values in a new order named after it, its indices a
    permutation into the input's order."""
    t, args = node.target, node.args
    if t not in (aten.sort.default, aten.sort.stable):
        return None
    x = args[0]
    sh = rf.shape(x)
    dim = node.kwargs.get("dim", args[1] if len(args) > 1 and t == aten.sort.default else -1)
    if not (sh and rf.rows(sh) and dim % len(sh) == 0):
        return None
    fx_ = rf.fact(x)
    if fx_.order == CONFLICT:
        return (RowFact(order=CONFLICT), RowFact(order=CONFLICT))
    return (RowFact(order=node.name, index_into=fx_.index_into),
            RowFact(order=node.name, index_into=(fx_.order, sh[0]), perm=True))


def _floor_div(rf: _RowFacts, node):
    """``positions // k`` of an index into natural rows: an index into the rows before a
    ``[rows, k] -> [rows·k]`` flattening."""
    t, args = node.target, node.args
    if t not in (aten.floor_divide.default, aten.div.Tensor_mode) or not isinstance(args[0], fx.Node):
        return None
    k = args[1]
    mode_ok = t == aten.floor_divide.default or node.kwargs.get("rounding_mode") == "floor"
    f = rf.fact(args[0])
    if mode_ok and isinstance(k, int) and k > 0 and f.index_into and f.index_into[0] is None \
            and f.index_into[1] % k == 0:
        return RowFact(order=f.order, index_into=(None, f.index_into[1] // k))
    return None


def _gather(rf: _RowFacts, node):
    """``x[i]`` on the rows with ``i`` an index into ``x``'s own order: a local gather."""
    if node.target != aten.index.Tensor:
        return None
    x, idx = node.args
    taken = [d for d, i in enumerate(idx) if i is not None]
    xs = rf.shape(x)
    if taken == [0] and xs and rf.rows(xs):
        fi, fxx = rf.fact(idx[0]), rf.fact(x)
        if fi.index_into == (fxx.order, xs[0]) and fxx.order != CONFLICT and fi.order != CONFLICT:
            return RowFact(order=fi.order, index_into=fxx.index_into, local_gather=True)
    return None


def _lookup(rf: _RowFacts, node):
    """``table[i]`` with ``i`` on the rows and ``table`` not (an embedding, gpt-oss's
    per-expert bias looked up by the sorted expert ids): one output row per row of
    ``i``, in ``i``'s order."""
    if node.target != aten.index.Tensor:
        return None
    x, idx = node.args
    taken = [d for d, i in enumerate(idx) if i is not None]
    xs, i_sh = rf.shape(x), (rf.shape(idx[0]) if taken == [0] else None)
    if xs and not rf.rows(xs) and i_sh and rf.rows(i_sh) and rf.fact(idx[0]).order != CONFLICT:
        return RowFact(order=rf.fact(idx[0]).order)
    return None


def _scatter(rf: _RowFacts, node):
    """``y[i] = v`` with ``i`` a permutation covering ``y``'s rows: the inverse permutation
    (``v`` an arange) or ``v``'s rows un-permuted (``v`` in ``i``'s order)."""
    if node.target not in (aten.index_put_.default, aten.index_put.default):
        return None
    args = node.args
    y, idx, v = args[:3]
    acc = args[3] if len(args) > 3 else node.kwargs.get("accumulate", False)
    ys = rf.shape(y)
    if not (len(idx) == 1 and idx[0] is not None and not acc and ys and rf.rows(ys)):
        return None
    fi, fv = rf.fact(idx[0]), rf.fact(v)
    vs = rf.shape(v)
    if not (fi.perm and fi.index_into and fi.index_into[1] == ys[0] and fi.order != CONFLICT
            and vs and vs[0] == ys[0]):
        return None
    if fv.identity:       # y[i[j]] = j: the inverse permutation
        return RowFact(order=fi.index_into[0], index_into=(fi.order, ys[0]), perm=True, local_scatter=True)
    if fv.order == fi.order:     # y[i[j]] = v[j]: v's rows un-permuted
        return RowFact(order=fi.index_into[0], index_into=fv.index_into, local_scatter=True)
    return None


def _keeps_rows(rf: _RowFacts, node) -> bool:
    """Whether ``node`` treats rows one by one (or leaves dim 0 alone), so its rows keep
    their inputs' order."""
    t, out_sh = node.target, rf.shape(node)
    return (t in _KEEP or t is grouped_linear or t in (aten.linear.default, aten.mm.default)
            or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags)
            or (t in _DIM_ARG_OPS and _dim_arg(node) not in (0, None))
            or (t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
                and out_sh and rf.shape(node.args[0])[0] == out_sh[0]))


def _any_op(rf: _RowFacts, node):
    """Any other op: its rows in its inputs' one order, CONFLICT where orders met or an op
    of unknown row semantics read permuted rows."""
    t, out_sh = node.target, rf.shape(node)
    ins = rf.rows_inputs(node)
    orders = {rf.fact(a).order for a in ins}
    if not orders or orders == {None}:
        if t in _LIKE or not out_sh or not rf.rows(out_sh):
            return _NOTHING
        # an op on natural rows: natural; index values pass through dtype casts only
        if t in _KEEP and ins and rf.fact(ins[0]).index_into:
            return rf.fact(ins[0])
        return _NOTHING
    if t in _LIKE:              # fresh contents: any order is as good as another
        return _NOTHING
    order = next(iter(orders)) if len(orders) == 1 else CONFLICT
    if not _keeps_rows(rf, node):
        if t in _INVARIANT:            # a sum / mean / max over the rows: any order gives the same
            return _NOTHING
        order = CONFLICT
    if isinstance(node.meta.get("val"), (list, tuple)):
        return tuple(RowFact(order=order) for _ in node.meta["val"])
    keep = rf.fact(ins[0]) if t in _KEEP and len(ins) == 1 else None
    return keep if keep is not None else RowFact(order=order)


#: the rules in the order they are tried; the first to answer settles a node
_RULES = (_getitem, _order_free, _arange, _sort, _floor_div, _gather, _lookup, _scatter, _any_op)


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
