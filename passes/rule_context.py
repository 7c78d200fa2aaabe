"""What a rule sees of the graph while the walk (:mod:`.propagate`) visits a node.

:class:`NodeContext` implements :class:`~autoshard.policies.base.RuleContext` for one
node: the layouts chosen so far, exact probe sizes (:class:`Shapes`), row facts, and
the look-ahead a Linear policy asks before it splits its output (does the split reach
a parallel consumer, :meth:`NodeContext.split_stop`). It reads the walk's state and
changes nothing.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from autoshard.ir.spec import ShardSpec, replicated
from autoshard.policies.base import SymbolicSizes

from .row_order import RowFact

__all__ = ["NodeContext", "Shapes", "aten_name", "is_tensor_val", "stop_note", "view_dim"]

aten = torch.ops.aten


def is_tensor_val(v) -> bool:
    """``v`` (a node's ``meta["val"]``) is a tensor.

        >>> is_tensor_val(torch.zeros(1)), is_tensor_val(3)
        (True, False)
    """
    return isinstance(v, torch.Tensor)


class Shapes:
    """Global shapes of graph values, as exact probe integers (each free symbol a
    distinct large prime, so products match only when they truly match) and as
    concrete integers for the plan's batch size and sequence length."""

    def __init__(self, bsym, ssym, batch_size, seq_len, shared: dict | None = None):
        self.probe_map, self.conc_map = {}, {}
        if bsym is not None:
            self.probe_map[bsym] = SymbolicSizes.BATCH
            self.conc_map[bsym] = batch_size
        if ssym is not None:
            self.probe_map[ssym] = SymbolicSizes.SEQ
            self.conc_map[ssym] = seq_len
        self.extra = SymbolicSizes.others()
        self._seen: dict = {}      # id(SymNode) -> (node, probe, concrete): a size is evaluated once
        self._vals: dict = {}      # id(value) -> (value, probe shape, concrete shape)
        # the shapes of the batch and sequence symbols alone (or none): their probe and concrete
        # sizes are the same in every Shapes of these symbols and sizes, so walks of one graph
        # under many policies share them (a search); one with another symbol, whose prime is
        # drawn in the order a walk meets it, stays in this walk's _vals
        self._base = frozenset(self.probe_map)
        self._shared: dict = {} if shared is None else shared

    def _ev(self, s, mp, probe: bool):
        if isinstance(s, int):
            return s
        if isinstance(s, torch.SymInt):
            hit = self._seen.get(id(s.node))
            if hit is None:
                expr = s.node.expr
                for f in expr.free_symbols:
                    if f not in self.probe_map:
                        self.probe_map[f] = next(self.extra)
                        hint = s.node.hint if isinstance(s.node.hint, int) else 8
                        self.conc_map[f] = hint
                hit = self._seen[id(s.node)] = (s.node, int(expr.xreplace(self.probe_map)),
                                                int(expr.xreplace(self.conc_map)))
            return hit[1] if probe else hit[2]
        return int(s)

    def probe(self, shape) -> tuple[int, ...]:
        return tuple(self._ev(s, None, True) for s in shape)

    def concrete(self, shape) -> tuple[int, ...]:
        return tuple(self._ev(s, None, False) for s in shape)

    def _of(self, v) -> tuple:
        # a value's shape read once per walk (once per search where it is of the batch and
        # sequence alone): rules and the counting pass ask for the same node's shape again
        # and again (a search plans hundreds of graphs)
        hit = self._shared.get(id(v))
        if hit is None or hit[0] is not v:
            hit = self._vals.get(id(v))
            if hit is None or hit[0] is not v:
                shape = v.shape
                hit = (v, self.probe(shape), self.concrete(shape))
                (self._shared if self._of_base(shape) else self._vals)[id(v)] = hit
        return hit

    def _of_base(self, shape) -> bool:
        return all(s.node.expr.free_symbols <= self._base if isinstance(s, torch.SymInt) else isinstance(s, int)
                   for s in shape)

    def probe_val(self, v) -> tuple[int, ...]:
        """:meth:`probe` of tensor ``v``'s shape (a node's ``meta["val"]``), remembered."""
        return self._of(v)[1]

    def concrete_val(self, v) -> tuple[int, ...]:
        """:meth:`concrete` of tensor ``v``'s shape, remembered."""
        return self._of(v)[2]



class NodeContext:
    """What a rule may see of the graph: implements
    :class:`~autoshard.policies.base.RuleContext` for the node being visited."""

    def __init__(self, engine, node: fx.Node):
        self.e, self.node = engine, node
        self.mesh = engine.mesh
        self.batch_axes = engine.batch_axes
        self.BATCH = SymbolicSizes.BATCH
        self.training = engine.training
        self.dropout = engine.dropout
        self.cp_attention = engine.policy.cp_attention
        self.cp_order = engine.policy.cp_order

    def is_tensor(self, a) -> bool:
        return isinstance(a, fx.Node) and is_tensor_val(a.meta.get("val"))

    def spec(self, a):
        if not isinstance(a, fx.Node):
            return None
        if a.op == "get_attr" and a.target in self.e.params:
            return self.e.st.param_spec.get(a.target) or replicated(a.meta["val"].dim())
        if self.is_free_state(a):
            return replicated(a.meta["val"].dim())
        return self.e.st.specs.get(a.name)

    def is_free_param(self, a) -> bool:
        return isinstance(a, fx.Node) and a.op == "get_attr" and a.target in self.e.params \
            and a.target not in self.e.st.param_spec

    def is_free_state(self, a) -> bool:
        return isinstance(a, fx.Node) and a.op == "placeholder" and a.name in self.e.state \
            and a.name not in self.e.st.specs

    def fixed_param_spec(self, a):
        return self.e.st.param_spec.get(a.target) if isinstance(a, fx.Node) and a.op == "get_attr" else None

    def pshape(self, a) -> tuple[int, ...]:
        return self.e.shapes.probe_val(a.meta["val"])

    def pshape_of_val(self, v) -> tuple[int, ...]:
        return self.e.shapes.probe_val(v)

    def local_numel(self, a, spec: ShardSpec) -> int:
        shape = self.e.shapes.concrete_val(a.meta["val"])
        return math.prod(spec.local_shape(shape, self.mesh))

    def local_size(self, a, spec: ShardSpec, d: int) -> int:
        shape = self.e.shapes.concrete_val(a.meta["val"])
        return spec.local_shape(shape, self.mesh)[d]

    def is_batch_index(self, a) -> bool:
        return isinstance(a, fx.Node) and a.name in self.e.st.batch_index

    def row_fact(self, a, i: int | None = None) -> RowFact:
        f = self.e.rows.get(a.name, RowFact()) if isinstance(a, fx.Node) else RowFact()
        if isinstance(f, tuple):
            return f[i] if i is not None else RowFact()
        return f

    def forced_replicate(self, node) -> bool:
        return node.name in self.e.forced

    def forced_reason(self, node) -> str:
        """Why a re-plan holds this Linear whole: the op that refused its output's split
        (empty when it is not forced)."""
        return self.e.forced_why.get(node.name, "") if node.name in self.e.forced else ""

    def default_out_spec(self, node):
        v = node.meta.get("val")

        def one(t):
            if not is_tensor_val(t):
                return None
            sh = self.e.shapes.probe_val(t)
            rows = sh and SymbolicSizes.is_rows(sh[0])
            return ShardSpec(dims=tuple(self.batch_axes if (rows and self.batch_axes and i == 0) else ()
                                        for i, s in enumerate(sh)))

        if isinstance(v, (list, tuple)):
            return tuple(one(t) for t in v)
        return one(v)

    # ----- look-ahead helpers for the Linear policies
    def output_segments(self, node) -> int:
        """Number of equal blocks a later ``split`` cuts this Linear's output into (fused QKV)."""
        n = self.e.shapes.probe_val(node.meta["val"])[-1]
        cur = node
        for _ in range(8):
            users = list(cur.users)
            if len(users) > 1:
                return self._slice_segments(cur, users)
            if len(users) != 1:
                return 1
            u = users[0]
            if u.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
                outs = u.meta["val"]
                d = (u.args[2] if len(u.args) > 2 else 0)
                sizes = {self.e.shapes.probe_val(o)[d] for o in outs}
                last = len(cur.meta["val"].shape) - 1
                return len(outs) if len(sizes) == 1 and d % (last + 1) == last else 1
            if u.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
                            aten.contiguous.default) and self.e.shapes.probe_val(u.meta["val"])[-1] == n:
                cur = u
                continue
            if (m := self._block_axis_segments(cur, u)) > 1:
                return m
            if u.target == aten.add.Tensor and self.e.shapes.probe_val(u.meta["val"])[-1] == n and \
                    any(isinstance(a, fx.Node) and a.op == "get_attr" for a in u.args):
                cur = u             # its bias, added apart (passes/token_fold.py)
                continue
            return 1
        return 1

    def _block_axis_segments(self, value, u) -> int:
        """``m`` when the view ``u`` cuts ``value``'s last dim into ``[m, units, ...]`` and
        every use of the new ``m`` axis picks its blocks (``unbind`` / ``select`` along it,
        after any permutes): ModernBERT's ``Wqkv`` viewed as ``[.., 3, heads, head_dim]``
        and unbound, timm's ``qkv`` reshaped to ``[B, N, 3, heads, head_dim]``, permuted
        and unbound (or indexed ``qkv[0]``); 1 otherwise."""
        if u.target not in _VIEWS:
            return 1
        a, b = self.e.shapes.probe_val(value.meta["val"]), self.e.shapes.probe_val(u.meta["val"])
        d = len(a) - 1
        if len(b) < d + 2 or b[:d] != a[:d] or b[d] < 2 or math.prod(b[d:]) != a[d]:
            return 1
        return b[d] if _picks_blocks(u, d) else 1

    def _slice_segments(self, value, users) -> int:
        """Number of equal pieces when every user slices ``value``'s last dim into
        equal, adjacent, step-1 pieces that cover it (Phi-3's sliced ``qkv_proj``)."""
        widths = self._slice_widths(value, users)
        return len(widths) if widths and len(set(widths)) == 1 else 1

    def _slice_widths(self, value, users) -> tuple[int, ...]:
        """The widths of the adjacent, step-1 pieces every user slices ``value``'s last
        dim into, in order, when they cover it; empty otherwise."""
        shape = self.e.shapes.probe_val(value.meta["val"])
        last, n = len(shape) - 1, shape[-1]
        pieces = set()
        for u in users:
            if u.target != aten.slice.Tensor:
                return ()
            a = list(u.args) + [None] * 5
            if (a[1] or 0) % len(shape) != last or (a[4] or 1) != 1:
                return ()
            start, end = a[2] or 0, n if a[3] is None else min(a[3], n)
            if not isinstance(start, int) or not isinstance(end, int):
                return ()
            pieces.add((start % n if start < 0 else start, end % n if end < 0 else end))
        cuts = sorted(pieces)
        if not cuts or cuts[0][0] != 0 or cuts[-1][1] != n or any(p[1] != q[0] for p, q in zip(cuts, cuts[1:])):
            return ()
        return tuple(e - b for b, e in cuts)

    def output_block_widths(self, node) -> tuple[int, ...]:
        """The widths of the adjacent blocks slices cut this Linear's output into, when
        they are unequal (Phi-3's ``qkv_proj`` with fewer kv heads: ``[:q]``, ``[q:q+kv]``,
        ``[q+kv:]``); empty otherwise. A policy that splits them per block gives the
        output ``ShardSpec.widths``: each rank holds its part of every block."""
        users = list(node.users)
        widths = self._slice_widths(node, users) if len(users) > 1 else ()
        return widths if len(set(widths)) > 1 else ()

    def unequal_blocks(self, node) -> str:
        """A stop note when slices cut this Linear's output into adjacent blocks of unequal
        widths (:meth:`output_block_widths`), for a policy that does not split them per
        block: a contiguous split would hand a rank pieces of q only; empty otherwise."""
        widths = self.output_block_widths(node)
        if not widths:
            return ""
        first = min(node.users, key=lambda u: (self._slice_start(u), u.name))
        return stop_note(first, f"a cut into fused blocks of unequal widths {widths}: split per block only where "
                                f"the blocks are equal")

    @staticmethod
    def _slice_start(u) -> int:
        start = u.args[2] if len(u.args) > 2 else 0
        return start if isinstance(start, int) and start >= 0 else 0

    def output_feeds_parallel_consumer(self, node) -> bool:
        """True when every path from this value reaches a Linear, the loss or the
        graph output through ops that keep a feature split (pointwise, views, attention).

        The split's dim is followed through views that cut it into ``[heads, head_dim]``
        (and back), transposes and broadcasting; a norm or reduction over other dims
        than the split one (a per-head q/k norm over ``head_dim`` while the heads are
        split) keeps it local, so it does not stop the split."""
        return not self.split_stop(node)

    def split_stop(self, node, unequal: bool = False) -> str:
        """Why the split of this value's last dim cannot reach a parallel consumer
        (:meth:`output_feeds_parallel_consumer`): the first op found that stops it, its
        node and what it does to the split dim; empty when every path passes. ``unequal``:
        the caller splits fused blocks of unequal widths per block (1d), so they do not stop it."""
        seen: set[tuple[str, int | None]] = set()
        rank_of = lambda n: getattr(n.meta.get("val"), "ndim", None)          # noqa: E731
        out_rank = rank_of(node)
        blocks = self.output_segments(node) if out_rank else 1
        if blocks == 1 and not unequal and (unequal_note := self.unequal_blocks(node)):
            return unequal_note
        stack = [(u, node, out_rank - 1 if out_rank else None) for u in node.users]
        while stack:
            u, src, d = stack.pop()
            if (u.name, d) in seen:
                continue
            seen.add((u.name, d))
            if (nd := _past_blocks(u, src, d, blocks)) is not None:
                stack.extend((w, u, nd) for w in u.users)
                continue
            ann = self.e.ann.get(u.name)
            if u.op == "output" or u.target in (aten._assert_tensor_metadata.default, aten.sym_size.int):
                continue
            if ann and ann.kind in ("linear", "loss"):
                continue
            t = u.target
            if t in _SPLITS:        # pieces along another dim keep the split (rotary halves: chunk over head_dim)
                nd, stop = _split_pieces(u, src, d, blocks)
                if stop:
                    return stop
                stack.extend((w, u, nd) for w in u.users)
                continue
            if t == operator.getitem and getattr(src, "target", None) in _SPLITS | _PICKS | {aten.max.dim, aten.min.dim}:
                stack.extend((w, u, d) for w in u.users)      # one piece (or the values / indices) of it
                continue
            if ann and ann.kind in ("norm", "reduction"):
                nd = _reduced_keeps(u, src, d)
                if nd is None and _is_statistic(u, src, d):
                    continue        # a norm's statistic over the split dim: a partial sum, all-reduced where used
                if nd is None:
                    return stop_note(u, f"a {ann.kind} over the split dim" if d is not None
                                 else f"a {ann.kind} after an op that loses track of the split dim")
                stack.extend((w, u, nd) for w in u.users)
                continue
            if ann and ann.kind == "embedding":
                return stop_note(u, "a lookup that reads it as indices")
            if t in _PASS_THROUGH or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
                nd = _contract_dim(u, src, d) if t in _CONTRACTS else _broadcast_dim(u, src, d)
                stack.extend((w, u, nd) for w in u.users)
                continue
            if t == aten.type_as.default:       # a cast (Gemma-3's norms): the split passes; a dtype donor's does not
                if u.args[0] is src:
                    stack.extend((w, u, d) for w in u.users)
                continue
            if t in (aten.max.dim, aten.min.dim):       # a search along another dim: both outputs keep the split
                nd = _reduced_keeps(u, src, d)
                if nd is None:
                    return stop_note(u, "a search over the split dim" if d is not None
                                 else "a search after an op that loses track of the split dim")
                stack.extend((w, u, nd) for w in u.users)
                continue
            if t in (aten.index_copy_.default, aten.index_copy.default):     # rows written into a cache:
                stack.extend((w, u, d) for w in u.users)                     # the same dims, another length
                continue
            if t == aten.new_empty.default or (t == aten.copy_.default and d is not None):
                # a buffer shaped like the split value (its split dim kept), or a write into a
                # buffer (the written value lines up with the buffer's dims): docs/design.md,
                # "Low-rank and latent projections"
                nd = _same_dim(u, src, d) if t == aten.new_empty.default else \
                    (d if u.args[0] is src else _broadcast_dim(u, src, d))
                stack.extend((w, u, nd) for w in u.users)
                continue
            if t == operator.getitem or (ann and ann.kind in ("view", "attention")):
                nd = view_dim(u, src, d) if ann and ann.kind == "view" else None
                if nd is None and (merged := _merged_under(u, src, d)):
                    return stop_note(u, merged)
                stack.extend((w, u, nd) for w in u.users)
                continue
            return stop_note(u, "an op with no rule that keeps a feature split")
        return ""

    def is_largest_embedding(self, w) -> bool:
        return w.target == self.e.largest_embedding


_CONTRACTS = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default,
              aten.scaled_dot_product_attention.default}


def _shape(n):
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(v.shape) if hasattr(v, "shape") else None


def stop_note(u, what: str) -> str:
    """``"`aten.mean.dim` at node `mean_3` (a norm over the split dim)"``: the op that
    stops a split, for a plan note."""
    return f"`{aten_name(u)}` at node `{u.name}` ({what})"


def aten_name(node) -> str:
    t = node.target
    return str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))


_SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default})
_PICKS = frozenset({aten.unbind.int, aten.select.int})
_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
_REORDERS = frozenset({aten.permute.default, aten.transpose.int, aten.contiguous.default, aten.clone.default,
                       aten.alias.default})


def _pick_dim(u) -> int:
    return u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)


def _picks_blocks(v, axis: int, depth: int = 0) -> bool:
    """Every use of ``v``'s dim ``axis`` picks single blocks of it: ``unbind`` or
    ``select`` along it, after permutes and transposes (which move it)."""
    nd = v.meta["val"].ndim
    if not v.users or depth > 4:
        return False
    for w in v.users:
        if w.target in _PICKS and _pick_dim(w) % nd == axis:
            continue
        if w.target == aten.permute.default:
            if not _picks_blocks(w, [p % nd for p in w.args[1]].index(axis), depth + 1):
                return False
        elif w.target == aten.transpose.int:
            i, j = (x % nd for x in w.args[1:3])
            if not _picks_blocks(w, j if axis == i else i if axis == j else axis, depth + 1):
                return False
        elif w.target in _REORDERS:
            if not _picks_blocks(w, axis, depth + 1):
                return False
        else:
            return False
    return True


def _past_blocks(u, src, d, blocks: int):
    """Where the split dim ``d`` of ``src`` is in the output of ``u`` when ``u`` is one of
    the ops by which a fused projection is read block by block (None otherwise): the view
    that cuts ``d``, made of ``blocks`` fused blocks, into ``[blocks, units, ...]`` (the
    split moves to the units: each rank holds its units of every block), or a pick
    (``unbind`` / ``select``) along another dim (the dims after it shift down)."""
    a, b = _shape(src), _shape(u)
    if d is None or a is None:
        return None
    if u.target in _PICKS and u.args[0] is src:
        dim = _pick_dim(u) % len(a)
        return None if dim == d else d - (dim < d)
    if b is None or blocks < 2 or u.target not in _VIEWS or len(b) < len(a) + 1 or tuple(b[:d]) != tuple(a[:d]):
        return None
    tail = len(a) - d - 1
    if b[d] != blocks or tuple(b[len(b) - tail:]) != tuple(a[d + 1:]) or math.prod(b[d:len(b) - tail]) != a[d]:
        return None
    return d + 1


def _contract_dim(u, src, d):
    """The split dim ``d`` of ``src`` in the output of the matmul ``u`` when it is one of
    its batch dims (attention's heads through ``QKᵀ`` and ``PV``); None otherwise."""
    a = _shape(src)
    if d is None or a is None or u.target not in (aten.matmul.default, aten.bmm.default) or d >= len(a) - 2:
        return None
    return _broadcast_dim(u, src, d)


def _split_pieces(u, src, d, blocks: int) -> tuple:
    """``(nd, stop)`` for the split / chunk ``u`` of ``src``: the split dim ``d`` in each piece
    (pieces along another dim keep it; None when the cut is along it), or a stop note where
    the cut along it makes pieces the split cannot follow (DeepSeek-V3's
    ``kv_a_proj_with_mqa``: a latent and a rope key every head reads), which the split
    rule would refuse: unequal widths, or not the Linear's ``blocks`` fused blocks."""
    dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)
    rank = len(_shape(src) or ())
    if d is None or not rank or not isinstance(dim, int):
        return None, ""
    if dim % rank != d:
        return d, ""
    widths = _piece_widths(u, d)
    if widths and (len(set(widths)) > 1 or len(widths) != blocks):
        return None, stop_note(u, f"a cut of the split dim into pieces of widths {widths}, not its "
                                  f"{blocks} equal block(s)")
    return None, ""


def _piece_widths(u, d) -> tuple:
    """The widths along ``d`` of the pieces ``split`` / ``chunk`` node ``u`` makes (literal
    sizes only); empty where one is symbolic."""
    widths = tuple(getattr(v, "shape", (None,) * (d + 1))[d] for v in u.meta.get("val", ()))
    return widths if all(isinstance(w, int) for w in widths) else ()


def _same_dim(u, src, d):
    """The split dim ``d`` of ``src`` in ``u = src.new_empty(sizes)`` when ``u`` has ``src``'s
    rank and size there (:func:`autoshard.policies.ops.creation.new_empty` then splits it
    alike); None otherwise."""
    a, b = _shape(src), _shape(u)
    if d is None or a is None or b is None or len(a) != len(b) or a[d] != b[d]:
        return None
    return d


def _broadcast_dim(u, src, d):
    """The split dim ``d`` of ``src`` in the output of the pointwise ``u`` (broadcasting
    prepends dims); None where unknown."""
    a, b = _shape(src), _shape(u)
    if d is None or a is None or b is None or len(b) < len(a):
        return None
    return d + len(b) - len(a)


def view_dim(u, src, d):
    """The split dim ``d`` of ``src`` in the output of the view ``u``: kept by a view that
    keeps the dims up to it, moved by a transpose, kept on the outer factor when the dim
    is cut in two (``[.., heads·hd] → [.., heads, hd]``) or merged with its inner neighbour
    (and back); None where unknown (the caller then stops at the next norm), sizes that
    depend on data (an unbacked ``u8`` no comparison can decide: Idefics3's connector) too."""
    return _undecided_on_data(_view_dim_of, None, u, src, d)


def _undecided_on_data(fn, default, *args):
    """``fn(*args)``, or ``default`` where a comparison of sizes that depend on data (an
    unbacked ``u``: Idefics3's connector) cannot be decided."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        return fn(*args)
    except GuardOnDataDependentSymNode:
        return default


def _view_dim_of(u, src, d):
    a, b = _shape(src), _shape(u)
    if d is None or a is None or b is None:
        return None
    if u.target == aten.transpose.int:
        i, j = (x % len(a) for x in u.args[1:3])
        return j if d == i else i if d == j else d
    if u.target == aten.permute.default:            # timm's qkv: [B, N, 3, heads, hd] -> [3, B, heads, N, hd]
        return [p % len(a) for p in u.args[1]].index(d)
    if u.target == aten.unsqueeze.default:          # a new size-1 dim (repeat_kv's [:, :, None])
        p = u.args[1] % len(b)
        return d if d < p else d + 1
    if u.target == aten.expand.default:             # broadcast to more (or new leading) dims
        return d + len(b) - len(a) if b[d + len(b) - len(a)] == a[d] else None
    if u.target not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return None
    nd = _reshaped_dim(a, b, d)
    if nd is None and 1 in tuple(a) + tuple(b) and a[d] != 1:
        # size-1 dims dropped or added beside the cut (DeepSeek-V3's kv_b_proj output
        # [b, 1, s, heads·d] viewed as [b, s, heads, d]): compare the shapes without them
        ka, kb = [i for i, x in enumerate(a) if x != 1], [i for i, x in enumerate(b) if x != 1]
        sd = _reshaped_dim([a[i] for i in ka], [b[i] for i in kb], ka.index(d))
        nd = None if sd is None else kb[sd]
    return nd


def _reshaped_dim(a, b, d):
    if a[:d] != b[:d]:
        return None
    if len(b) > d and b[d] == a[d] and a[d + 1:] == b[d + 1:]:
        return d
    k = len(b) - len(a) + 1
    if k > 1 and len(b) >= d + k and math.prod(b[d:d + k]) == a[d] and a[d + 1:] == b[d + k:]:
        return d            # cut in two or more (Bloom's [heads, 3, hd]): the split stays on the outer factor
    if len(a) == len(b) + 1 and len(a) > d + 1 and a[d] * a[d + 1] == b[d] and a[d + 2:] == b[d + 1:]:
        return d                                   # merged with its inner neighbour
    return None


def _merged_under(u, src, d) -> str:
    """What a reshape that merges the split dim ``d`` into the dim before it does to the
    split (Bloom's ``[b, heads, s, hd] → [b·heads, s, hd]``): each rank's heads would be
    ``b`` blocks of the merged dim, one per outer index, a split no spec expresses (its
    segment count would be the batch); empty for any other op, and where sizes that depend
    on data (Idefics3's connector) leave it undecided."""
    return _undecided_on_data(_merged_text, "", u, src, d)


def _merged_text(u, src, d) -> str:
    a, b = _shape(src), _shape(u)
    if u.target not in _VIEWS or d is None or not d or a is None or b is None or len(a) != len(b) + 1:
        return ""
    if a[:d - 1] != b[:d - 1] or a[d + 1:] != b[d:] or a[d - 1] * a[d] != b[d - 1]:
        return ""
    return (f"reshape {SymbolicSizes.text(a)}->{SymbolicSizes.text(b)} merges the split dim {d} under dim {d - 1}: "
            f"a rank's part would be one block per index of dim {d - 1}, a split a spec cannot express")


def _reduced_keeps(u, src, d):
    """Where the split dim ``d`` of ``src`` is in the output of the norm / reduction ``u``
    when ``u`` does not reduce over it; None when it does (or when unknown)."""
    a, b = _shape(src), _shape(u)
    if d is not None and a is not None and u.target in (aten.max.dim, aten.min.dim) and u.args[0] is src:
        dim = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", -1)    # values and indices (a tuple)
        if not isinstance(dim, int) or dim % len(a) == d:
            return None
        keep = u.args[2] if len(u.args) > 2 else u.kwargs.get("keepdim", False)
        return d if keep or dim % len(a) > d else d - 1
    if d is None or a is None or b is None or not u.args or u.args[0] is not src:
        return None
    if u.target in (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var.correction):
        dims = u.args[1] if len(u.args) > 1 else None
        if not isinstance(dims, (list, tuple)) or not dims:
            return None
        red = {x % len(a) for x in dims}
        if d in red:
            return None
        keep = (u.args[2] if len(u.args) > 2 else u.kwargs.get("keepdim", False))
        return d if keep else d - sum(1 for r in red if r < d)
    if u.target == aten.layer_norm.default:
        return d if d < len(a) - len(u.args[1]) else None
    return None


def _is_statistic(u, src, d) -> bool:
    """``u`` is a mean or sum over exactly the split dim ``d`` of ``src``, kept as a
    size-1 dim: an RMSNorm's mean square over features split across ranks (OLMo-2's
    q/k norms over the whole projection). Its value is a partial sum the first op not
    linear in it all-reduces (``[..., 1]`` per token), and the normalised features keep
    their split: a distributed norm with no gather of the features."""
    a = _shape(src)
    if d is None or a is None or not u.args or u.args[0] is not src:
        return False
    if u.target not in (aten.mean.dim, aten.sum.dim_IntList):
        return False
    dims = u.args[1] if len(u.args) > 1 else None
    keep = u.args[2] if len(u.args) > 2 else u.kwargs.get("keepdim", False)
    return isinstance(dims, (list, tuple)) and {x % len(a) for x in dims} == {d} and bool(keep)


_PASS_THROUGH = {aten.dropout.default, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                 aten.scaled_dot_product_attention.default, aten.to.dtype, aten.to.dtype_layout,
                 aten._to_copy.default, aten.slice.Tensor, aten.cat.default, aten.matmul.default,
                 aten.bmm.default, aten.softmax.int, aten._softmax.default, aten.stack.default,
                 aten.baddbmm.default, aten.flatten.using_ints}

