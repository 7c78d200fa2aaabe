"""Pad a vocabulary that does not divide the split, exactly (Megatron's
``make-vocab-size-divisible-by``), as a rewrite of the dense graph.

The largest embedding table ``[V, h]`` and every Linear weight (and bias) with
``V`` output features get ``Vp - V`` zero rows, ``Vp`` the next multiple of the
mode's vocabulary split. The padded dimension is then followed through the
graph: ops that keep columns apart (pointwise ops, views that keep the padded
dim whole, slices and selects on other dims, transposes) carry it; a
cross-entropy over it gets the padded logits set to ``-inf`` first (they take
no probability, so loss and gradients are the dense ones); every other consumer,
and the graph output, gets the first ``V`` entries back (``logits`` keep the
dense shape). The padded graph is itself a dense graph equal to the original,
and the planner shards it like any other: the vocabulary now divides.

The padding is recorded on :class:`~autoshard.passes.capture.Captured`
(``padding``) and on each :class:`~autoshard.ir.plan.ParamPlan` (``dense_shape``),
so loading and saving (``from_pretrained``, ``save_pretrained``, checkpoints)
keep the unpadded Hugging Face shapes.

    >>> import transformers
    >>> from autoshard.passes.capture import capture
    >>> m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    ...     n_embd=32, n_layer=1, n_head=2, vocab_size=65, n_positions=32))
    >>> cap = pad_vocab(capture(m), 4)
    >>> cap.padding[0].dense, cap.padding[0].padded, sorted(cap.padding[0].names)
    (65, 68, ['lm_head.weight', 'transformer.wte.weight'])
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import Counter
from dataclasses import dataclass

import torch
from torch import fx
from torch._guards import detect_fake_mode

from autoshard.ir.errors import AutoshardWarning
from autoshard.ir.log import warn
from autoshard.policies.generic import TRIM_META
from autoshard.policies.linear_ops import linear_operands

from .annotate import LINEAR_OPS
from .capture import Captured, copy_sharing
from .fake_replay import run_fake
from .pad_ops import SPLITS as _SPLITS, VIEWS as _VIEWS, is_pointwise as _is_pointwise, keeps_zero as _keeps_zero, \
    len_users as _len_users, node_val as _val, out_layout as _layout, same_size as _same, size_ratio as _ratio, \
    vocab_params as _vocab_params

aten = torch.ops.aten

__all__ = ["Padding", "pad_hidden", "pad_vocab", "pad_widths", "zero_padded"]


@dataclass(frozen=True)
class Padding:
    """Parameters (every name of each, tied ones included) padded on ``dim`` from
    ``dense`` to ``padded`` entries. ``segments`` > 1: the dim is that many equal
    blocks fused (GPT-2's ``c_attn``: q, k, v), each padded at its own end."""

    names: tuple[str, ...]
    dim: int
    dense: int
    padded: int
    segments: int = 1
    copies: int = 0       # > 0: each block holds that many copies of its one dense unit instead of zeros
    unit: int = 0         # > 0: a width padded in units this wide (heads), not the vocabulary


@dataclass(frozen=True)
class _Dim:
    """How one dim of a padded value is laid out: ``segs`` blocks, each of ``np``
    units of which the first ``n`` are the dense ones (the rest zeros, or, where
    ``zero`` is False, values nothing reads), each unit ``unit`` entries wide."""

    dim: int
    n: int
    np: int
    unit: int = 1
    segs: int = 1
    zero: bool = True
    copies: bool = False    # the extra units repeat the block's one dense unit (a kv head held by r ranks)
    fan: int = 0            # copies: the query heads each copy serves (what repeat_kv's expand becomes)
    punit: int = 0          # the padded width of a unit where it differs from ``unit`` (copies fanned out)
    fanned: tuple = ()      # (dim, dense size): a dim an expand fanned out to ``fan``, until a reshape merges it
    head: int = 0           # the Linear's features per head where its units are heads (what the plan counts in)

    @property
    def family(self) -> tuple[int, int]:
        return (self.n, self.np)

    @property
    def pu(self) -> int:
        return self.punit or self.unit

    @property
    def size(self) -> int:
        return self.segs * self.np * self.pu

    def at(self, dim: int, **kw) -> "_Dim":
        return dataclasses.replace(self, dim=dim, **kw)


_CE = {aten.cross_entropy_loss.default}
_SDPA = {aten.scaled_dot_product_attention.default}


class _Trim(Exception):
    """The node cannot take the padded value: give it the dense entries. ``blame``: the
    padded dim at fault where the node could take the others (a Linear padded on both
    its input and its weight: the weight's padding is the one to drop)."""

    def __init__(self, blame: "_Dim | None" = None):
        super().__init__()
        self.blame = blame


class _Padder:
    """Follows padded dims through the graph (docs/design.md, "Uneven widths"):
    each padded value's :class:`_Dim`; a node that cannot take one gets the dense
    entries back (a trim)."""

    def __init__(self, gm: fx.GraphModule, params: dict[str, _Dim], *, mask_loss: bool = False,
                 grow: bool = False, fixed: dict | None = None):
        self.gm = gm
        # parameters padded before (the vocabulary, heads) -> their padded dims: not grown again on those
        self.fixed = fixed or {}
        self.grow = grow                      # a Linear on padded in features: zero columns (else a trim)
        self.trims: list[_Dim] = []           # what had to be trimmed (before the graph's output)
        self.params = params                  # get_attr target -> its padded dim
        self.mask_loss = mask_loss            # a cross-entropy over a padded class dim: mask, not trim
        self.padded: dict[fx.Node, _Dim] = {}
        self.grown: dict[str, _Dim] = {}      # weights padded on their in features along the walk
        self.fake = detect_fake_mode([_val(n) for n in gm.graph.nodes if _val(n) is not None])

    # ------------------------------------------------------------ meta values
    def _refresh(self, node: fx.Node) -> None:
        if node.op == "get_attr":
            t = self.gm.get_parameter(node.target)
            node.meta["val"] = self.fake.from_tensor(t, static_shapes=True)
            return
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
        node.meta["val"] = run_fake(self.fake, node.target, args, kwargs)      # remembered across candidates
        node.meta.pop("tensor_meta", None)

    def _insert(self, before: fx.Node, target, args, kwargs=None) -> fx.Node:
        g = self.gm.graph
        with g.inserting_before(before):
            n = g.call_function(target, args, kwargs or {})
        for k in ("nn_module_stack", "stack_trace"):
            if k in before.meta:
                n.meta[k] = before.meta[k]
        self._refresh(n)
        return n

    def _trim(self, node: fx.Node, arg: fx.Node) -> fx.Node:
        p = self.padded[arg]
        if node.op != "output":
            self.trims.append(p)
        if p.pu != p.unit or p.fanned:
            raise _Unsupported(f"{node.format_node()} takes fanned-out copies", family=p.family)
        if p.segs == 1:
            n = self._insert(node, aten.slice.Tensor, (arg, p.dim, 0, p.n * p.unit))
        else:       # each fused block's dense entries, joined again
            parts = self._insert(node, aten.split.Tensor, (arg, p.np * p.unit, p.dim))
            kept = [self._insert(node, aten.slice.Tensor,
                                 (self._insert(node, operator.getitem, (parts, i)), p.dim, 0, p.n * p.unit))
                    for i in range(p.segs)]
            n = self._insert(node, aten.cat.default, (kept, p.dim))
        n.meta[TRIM_META] = True
        return n

    def _mask(self, node: fx.Node, x: fx.Node) -> fx.Node:
        """``x`` with its padded entries on the last dim set to -inf."""
        v, p = _val(x), self.padded[x]
        g = self.gm.graph
        with g.inserting_before(node):
            ar = g.call_function(aten.arange.default, (p.np,), {"dtype": torch.int64, "device": v.device})
        self._refresh(ar)
        pad = self._insert(node, aten.ge.Scalar, (ar, p.n))
        return self._insert(node, aten.masked_fill.Scalar, (x, pad, float("-inf")))

    # ------------------------------------------------------------ dim rules
    def _linear(self, node: fx.Node) -> _Dim | None:
        pd = self.padded
        xp, wp, bp, nd, kd = linear_operands(node)
        a = node.args
        x, w = a[xp[0]], a[wp[0]]
        b = a[bp[0]] if bp else None
        px, pw, pb = pd.get(x), pd.get(w), pd.get(b) if isinstance(b, fx.Node) else None
        wv = _val(w)
        if px is not None:
            # in features padded: the weight gets zero columns there (a contraction over zeros);
            # padded entries that may not be zero are zeroed first, so the weight's zeros get no gradient
            if pw is not None:      # a contraction over zeros on both sides (a tied head over a padded hidden)
                if pw.dim == kd and px.zero and pw.family == px.family and pw.segs == px.segs == 1 and pb is None:
                    return None
                if pw.dim != nd:    # (out features padded as well: a hidden → hidden Linear, grown below too)
                    raise _Trim(blame=pw)
            out = None if pw is None else pw.at(_val(node).dim() - 1)
            bias_ok = pb is None if pw is None else not isinstance(b, fx.Node) or (pb is not None and pb.family == pw.family)
            if not self.grow or px.dim != _val(x).dim() - 1 or not bias_ok or px.copies or px.pu != px.unit or \
                    not (isinstance(w, fx.Node) and w.op == "get_attr") or wv.dim() != 2 or \
                    kd in self.fixed.get(w.target, ()) or _len_users(self.gm, w.target) != 1:
                raise _Trim(blame=pw)
            if not px.zero:         # padded entries that may not be zero: zeroed, so the zero columns get no gradient
                node.args = tuple(self._zeroed(node, x) if i == xp[0] else v for i, v in enumerate(node.args))
            self._grow(w, px.at(kd, zero=True))
            return out
        if pw is None or pw.dim != nd or wv.dim() != 2:
            raise _Trim
        if isinstance(b, fx.Node) and (pb is None or pb.family != pw.family) and _val(b) is not None and _val(b).dim():
            raise _Trim
        return pw.at(_val(node).dim() - 1)

    def _zeroed(self, node: fx.Node, x: fx.Node) -> fx.Node:
        """``x`` times a 0/1 mask of its padded (last) dim: the padded units zero."""
        p = self.padded[x]
        g = self.gm.graph
        with g.inserting_before(node):
            ar = g.call_function(aten.arange.default, (p.size,), {"dtype": torch.int64, "device": _val(x).device})
        self._refresh(ar)
        u = self._insert(node, aten.floor_divide.default, (ar, p.unit))
        if p.segs > 1:
            u = self._insert(node, aten.remainder.Scalar, (u, p.np))
        keep = self._insert(node, aten.lt.Scalar, (u, p.n))
        out = self._insert(node, aten.mul.Tensor, (x, keep))
        self.padded[out] = p.at(p.dim, zero=True)
        return out

    def _grow(self, w: fx.Node, p: _Dim) -> None:
        """Pad the weight ``w`` on ``p.dim`` with zeros (its in features meet a padded input)."""
        name = w.target
        t = self.gm.get_parameter(name)
        grown = torch.nn.Parameter(_pad_tensor(t, p), requires_grad=t.requires_grad)
        mod_path, _, attr = name.rpartition(".")
        setattr(self.gm.get_submodule(mod_path) if mod_path else self.gm, attr, grown)
        self.grown[name] = p
        self._refresh(w)

    def _view(self, node: fx.Node, p: _Dim) -> _Dim:
        """A reshape of a padded value: the output dim that holds the padded units whole
        (what lies before them folds into ``segs``, what lies after into ``unit``);
        its literal size is patched to the padded one."""
        x = node.args[0]
        padded_in = list(_val(x).shape)
        dense_in = list(padded_in)
        dense_in[p.dim] = p.segs * p.n * p.unit
        if p.fanned:
            dense_in[p.fanned[0]] = p.fanned[1]
        s_out = list(_val(node).shape)          # not refreshed yet: the dense result
        shape = list(node.args[1])
        before = math.prod(dense_in[:p.dim]) * p.segs
        after = math.prod(dense_in[p.dim + 1:]) * p.unit
        after_p = math.prod(padded_in[p.dim + 1:]) * p.pu
        for e in range(len(s_out)):
            segs = _ratio(before, math.prod(s_out[:e]))
            unit = _ratio(after, math.prod(s_out[e + 1:]))
            if segs is None or unit is None or not _same(s_out[e], segs * p.n * unit):
                continue
            pu = _ratio(after_p, math.prod(s_out[e + 1:]))
            if pu is None or (p.fanned and not p.fanned[0] > p.dim):
                raise _Trim
            if isinstance(shape[e], int) and shape[e] != -1:
                shape[e] = segs * p.np * pu
            elif shape[e] != -1:
                raise _Trim
            node.args = (x, shape) + tuple(node.args[2:])
            return p.at(e, unit=unit, segs=segs, punit=pu if pu != unit else 0, fanned=())
        raise _Trim

    def _out_dim(self, node: fx.Node) -> _Dim | None:
        """The padded dim of ``node``'s output (None: not padded); raises _Trim."""
        t, a = node.target, node.args
        pd = self.padded
        if t == aten.embedding.default:     # a table padded on its rows (vocabulary) or columns (hidden)
            if a[1] in pd or pd.get(a[0]) is None:
                raise _Trim
            return pd[a[0]].at(_val(node).dim() - 1) if pd[a[0]].dim == 1 else None
        if t in LINEAR_OPS:
            return self._linear(node)
        if t in _SDPA:
            return self._sdpa(node)
        if not isinstance(_val(node), torch.Tensor):
            raise _Trim
        if _is_pointwise(t):
            return self._pointwise(node)
        x = a[0]
        p = pd.get(x)
        if p is None or any(n in pd for n in node.all_input_nodes if n is not x):
            if t == aten.cat.default:
                return self._cat(node)
            raise _Trim
        if t in _VIEWS:
            return self._view(node, p)
        if p.fanned:
            raise _Trim
        if t == aten.expand.default:
            return self._expand(node, p)
        return self._moved(node, p)

    def _sdpa(self, node: fx.Node) -> _Dim:
        """Attention over q, k, v padded alike on their heads (dim 1), or k/v holding copies
        of their kv head that each kv group's query slots read."""
        a, pd = node.args, self.padded
        ps = [pd.get(q) for q in a[:3]]
        if any(p is None or p.dim != 1 or p.fanned for p in ps) or \
                any(isinstance(m, fx.Node) and m in pd for m in list(a[3:]) + list(node.kwargs.values())):
            raise _Trim
        pq, pk, pv = ps
        alike = len({(p.family, p.segs, p.unit, p.pu) for p in ps}) == 1 and not pq.copies
        # kv heads held by r ranks: in each kv group's block, every query slot reads a copy of its kv head
        copied = not pq.copies and pq.pu == 1 and all(
            p.copies and p.n == 1 and p.segs == pq.segs and p.np * p.pu == pq.np and p.unit == pq.n
            for p in (pk, pv))
        if not (alike or copied):
            raise _Trim
        return pq.at(1, zero=pv.zero and not pv.copies)

    def _pointwise(self, node: fx.Node) -> _Dim:
        """A pointwise op: its padded operands padded alike (broadcast to the output's
        rank), the others of size 1 on the padded dim; zero where it keeps zeros zero."""
        pd, r = self.padded, _val(node).dim()
        where = None
        for n in node.all_input_nodes:
            v = _val(n)
            if n in pd and isinstance(v, torch.Tensor):
                p = pd[n].at(pd[n].dim + r - v.dim())
                if where is not None and dataclasses.replace(where, zero=True) != dataclasses.replace(p, zero=True):
                    raise _Trim
                where = p
        for n in node.all_input_nodes:
            v = _val(n)
            if n in pd or not isinstance(v, torch.Tensor):
                continue
            q = where.dim - (r - v.dim())
            if q >= 0 and not _same(v.shape[q], 1):
                raise _Trim
        if where.fanned:
            raise _Trim
        zero = {n for n in node.all_input_nodes if n in pd and pd[n].zero and not pd[n].copies}
        return where.at(where.dim, zero=bool(zero) and _keeps_zero(node, zero))

    def _expand(self, node: fx.Node, p: _Dim) -> _Dim:
        """An expand of a padded value; its literal size on the padded dim patched."""
        x, a = node.args[0], node.args
        d, nx = p.dim, _val(x).dim()
        shape = list(a[1])
        k = d + len(shape) - nx
        j = d + 1                           # the input dim after the padded one
        if p.copies and p.fan and j < nx and _same(_val(x).shape[j], 1) and isinstance(shape[k + 1], int) \
                and shape[k + 1] > 1:
            # repeat_kv: each copy of a kv head serves ``fan`` query slots, not the dense group
            fanned = (k + 1, shape[k + 1])
            shape[k + 1] = p.fan
            if shape[k] == p.segs * p.n * p.unit:
                shape[k] = p.size
            node.args = (x, shape) + tuple(a[2:])
            return p.at(k, fanned=fanned)
        if shape[k] not in (-1, _val(x).shape[d]) and not _same(shape[k], _val(x).shape[d]):
            if shape[k] != p.segs * p.n * p.unit:
                raise _Trim
            shape[k] = p.segs * p.np * p.unit
            node.args = (x, shape) + tuple(a[2:])
        elif shape[k] == p.segs * p.n * p.unit and p.n != p.np:
            shape[k] = p.segs * p.np * p.unit
            node.args = (x, shape) + tuple(a[2:])
        return p.at(k)

    def _moved(self, node: fx.Node, p: _Dim) -> _Dim:
        """Ops that keep the padded dim whole and only move it (dropout, slices and selects
        on other dims, transposes, permutes, unsqueezes)."""
        t, a = node.target, node.args
        d, nx = p.dim, _val(a[0]).dim()
        if t in (aten.dropout.default,):
            return p
        if t == aten.slice.Tensor:
            if (a[1] if len(a) > 1 else 0) % nx == d:
                raise _Trim
            return p
        if t == aten.select.int:
            dim = a[1] % nx
            if dim == d:
                raise _Trim
            return p.at(d - (dim < d))
        if t == aten.t.default:
            return p.at(1 - d if nx == 2 else d)
        if t == aten.transpose.int:
            i, j = a[1] % nx, a[2] % nx
            return p.at(j if d == i else i if d == j else d)
        if t == aten.permute.default:
            return p.at([q % nx for q in a[1]].index(d))
        if t == aten.unsqueeze.default:
            return p.at(d + ((a[1] % (nx + 1)) <= d))
        raise _Trim

    def _cat(self, node: fx.Node) -> _Dim:
        """A cat along another dim of values padded alike (rotary's rotate-half)."""
        xs, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
        ps = [self.padded.get(x) for x in xs]
        if any(p is None for p in ps) or len({dataclasses.replace(p, zero=True) for p in ps}) != 1 or \
                dim % _val(xs[0]).dim() == ps[0].dim:
            raise _Trim
        return ps[0].at(ps[0].dim, zero=all(p.zero for p in ps))

    def _split(self, node: fx.Node) -> None:
        """A split of a padded fused value into its blocks (GPT-2's q, k, v): each output
        a padded value of one block."""
        x = node.args[0]
        p = self.padded[x]
        nx = _val(x).dim()
        t = node.target
        dim = (node.args[2] if len(node.args) > 2 else 0) % nx
        block = p.n * p.unit
        if dim != p.dim or p.segs == 1:
            raise _Trim
        if t == aten.split.Tensor and node.args[1] == block:
            node.args = (x, p.np * p.unit) + tuple(node.args[2:])
        elif t == aten.split_with_sizes.default and list(node.args[1]) == [block] * p.segs:
            node.args = (x, [p.np * p.unit] * p.segs) + tuple(node.args[2:])
        elif t == aten.chunk.default and node.args[1] == p.segs:
            pass
        else:
            raise _Trim
        self._refresh(node)
        for u in node.users:
            if u.target is operator.getitem:
                self._refresh(u)
                self.padded[u] = p.at(dim, segs=1)

    def _mean(self, node: fx.Node) -> bool:
        """A mean over a zero-padded dim (a norm's statistic over a padded hidden size) times
        ``padded / dense``: the mean over the dense entries (docs/design.md, "Uneven widths")."""
        x = node.args[0]
        p, nx = self.padded.get(x), _val(x).dim()
        if p is None or not p.zero or p.fanned or p.copies or p.pu != p.unit or \
                p.dim not in [d % nx for d in node.args[1]] or any(n in self.padded for n in node.args[1:]):
            return False
        self._refresh(node)
        with self.gm.graph.inserting_after(node):
            m = self.gm.graph.call_function(aten.mul.Tensor, (node, p.size / (p.segs * p.n * p.unit)))
        node.replace_all_uses_with(m, delete_user_cb=lambda u: u is not m)
        m.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta})
        self._refresh(m)
        return True

    def _layer_norm(self, node: fx.Node) -> bool:
        """A LayerNorm over a zero-padded last dim (a padded hidden size), written out with
        its statistics over the dense entries: the mean and the variance as :meth:`_mean`'s
        scaled means, the centred values ``x − μ`` masked to 0 on the padded columns (there
        they would be ``−μ``), so the output is 0 there too, its weight and bias being zero
        (docs/design.md, "Uneven widths")."""
        x, shape, w, b, eps = (list(node.args) + [None] * 5)[:5]
        p, v = self.padded.get(x), _val(x)
        eps = 1e-5 if eps is None else eps
        if p is None or not p.zero or p.fanned or p.copies or p.pu != p.unit or p.segs != 1 or p.unit != 1 or \
                p.dim != v.dim() - 1 or len(shape) != 1 or not _same(shape[0], p.n) or \
                any(isinstance(t, fx.Node) and (self.padded.get(t) is None or self.padded[t].family != p.family)
                    for t in (w, b)):
            return False
        g = self.gm.graph
        with g.inserting_before(node):
            ar = g.call_function(aten.arange.default, (p.np,), {"dtype": torch.int64, "device": v.device})
        self._refresh(ar)
        keep = self._insert(node, aten.lt.Scalar, (ar, p.n))
        scale = p.np / p.n

        def mean(t):
            return self._insert(node, aten.mul.Tensor, (self._insert(node, aten.mean.dim, (t, [-1], True)), scale))
        # the mean of the masked x: the padded columns hold zeros, but x − μ must not read them (their gradient
        # would not be 0, and the zero columns of the Linears writing the stream would take it)
        mu = mean(self._insert(node, aten.mul.Tensor, (x, keep)))
        xc = self._insert(node, aten.mul.Tensor, (self._insert(node, aten.sub.Tensor, (x, mu)), keep))
        var = mean(self._insert(node, aten.mul.Tensor, (xc, xc)))
        y = self._insert(node, aten.mul.Tensor,
                         (xc, self._insert(node, aten.rsqrt.default, (self._insert(node, aten.add.Tensor, (var, eps)),))))
        if isinstance(w, fx.Node):
            y = self._insert(node, aten.mul.Tensor, (y, w))
        if isinstance(b, fx.Node):
            y = self._insert(node, aten.add.Tensor, (y, b))
        node.replace_all_uses_with(y)
        self.gm.graph.erase_node(node)
        self.padded[y] = p.at(p.dim, zero=True)
        return True

    # ------------------------------------------------------------ the walk
    def run(self) -> None:
        for node in list(self.gm.graph.nodes):
            try:
                self._visit(node)
            except _Unsupported:
                raise
            except Exception as e:  # noqa: BLE001 - an op the pass cannot follow: no padding, named
                raise _Unsupported(f"{node.format_node()}: {type(e).__name__}: {e}") from e

    def _visit(self, node: fx.Node) -> None:
        if node.op == "get_attr" and node.target in self.params:
            self._refresh(node)
            self.padded[node] = self.params[node.target]
            return
        if node.op == "output":
            node.args = fx.map_arg(node.args, lambda n: self._trim(node, n) if n in self.padded else n)
            return
        if node.op != "call_function" or not any(n in self.padded for n in node.all_input_nodes):
            return
        if node.target is operator.getitem and node in self.padded:
            return
        if node.target == aten.mean.dim and self._mean(node) or \
                node.target == aten.layer_norm.default and self._layer_norm(node) or \
                node.target == aten._assert_tensor_metadata.default \
                and len(node.args) < 2 and node.kwargs.get("size") is None and node.kwargs.get("stride") is None:
            return      # (a cast's check of dtype and device: the padding changes neither)
        if self.mask_loss and node.target in _CE:
            x = node.args[0]
            p = self.padded.get(x)
            if node.args[1] not in self.padded and p is not None and p.dim == 1 and p.segs == 1 and \
                    p.unit == 1 and _val(x).dim() == 2:
                node.args = (self._mask(node, x),) + tuple(node.args[1:])
                self._refresh(node)
                return
        if node.target in _SPLITS and node.args[0] in self.padded:
            try:
                return self._split(node)
            except _Trim:
                pass
        if node.target is operator.getitem:
            raise _Unsupported(f"{node.format_node()} takes a padded multi-output value")
        try:
            d = self._out_dim(node)
        except _Trim as e:
            mark = len(self.trims)
            node.args, node.kwargs = fx.map_arg(
                (node.args, node.kwargs), lambda n: self._trim(node, n) if n in self.padded else n)
            if e.blame is not None:
                self.trims[mark:] = [e.blame]
            d = None
        self._refresh(node)
        if d is not None:
            self.padded[node] = d


class _Unsupported(Exception):
    def __init__(self, msg: str, family=None):
        super().__init__(msg)
        self.family = family


def _padded_dims(cap: Captured) -> dict[str, tuple[int, ...]]:
    """Every name of a parameter padded before -> the dims it is padded on."""
    out: dict[str, tuple[int, ...]] = {}
    for p in cap.padding:
        for n in p.names:
            out[n] = out.get(n, ()) + (p.dim,)
    return out


def _pad_tensor(t: torch.Tensor, p: _Dim) -> torch.Tensor:
    """``t`` (detached) laid out as ``p``: each of its ``p.segs`` blocks on ``p.dim`` grown
    with zero units from ``p.n`` to ``p.np``."""
    t = t.detach()
    if p.copies:            # each block's one unit, repeated
        return torch.cat([b for b in t.chunk(p.segs, p.dim) for _ in range(p.np)], dim=p.dim)
    if p.segs == 1:
        return zero_padded(t, p.dim, p.np * p.unit)
    return torch.cat([zero_padded(b, p.dim, p.np * p.unit) for b in t.chunk(p.segs, p.dim)], dim=p.dim)


def zero_padded(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` (detached) with zero rows appended on ``dim`` up to ``size``: a padded vocabulary.

    >>> zero_padded(torch.ones(2, 3), 0, 4).tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    t = t.detach()
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def pad_vocab(cap: Captured, multiple: int, vocab: int | None = None) -> Captured:
    """``cap`` with its vocabulary padded to a multiple of ``multiple`` (the same
    ``cap`` where it divides already, or where nothing is to pad). ``cap`` itself
    is not changed: the result holds a copy of the graph module sharing every
    parameter that is not padded. ``vocab``: the vocabulary's size where the graph
    alone cannot tell it (an encoder without the head: its largest table may be the
    positions)."""
    if multiple <= 1 or cap.padding:
        return cap
    gm = cap.module
    found = _vocab_params(gm, vocab)
    if found is None or found[0] % multiple == 0:
        return cap
    V, params = found
    Vp = math.ceil(V / multiple) * multiple
    new = copy_sharing(gm)
    names: dict[int, list[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        if id(p) in params:
            names.setdefault(id(p), []).append(name)
    targets: dict[str, int] = {}
    padding = []
    for key, (p, dim) in params.items():
        grown = torch.nn.Parameter(zero_padded(p, dim, Vp), requires_grad=p.requires_grad)
        for name in names[key]:
            mod_path, _, attr = name.rpartition(".")
            setattr(new.get_submodule(mod_path) if mod_path else new, attr, grown)
            targets[name] = dim
        padding.append(Padding(names=tuple(names[key]), dim=dim, dense=V, padded=Vp))
    # get_attr targets are the parameter names with dots
    padder = _Padder(new, {n.target: _Dim(targets[n.target], V, Vp) for n in new.graph.nodes
                           if n.op == "get_attr" and n.target in targets}, mask_loss=True)
    try:
        padder.run()
    except _Unsupported as e:           # the vocabulary stays whole (replicated, exact), as without padding
        warn(f"the vocabulary {V} is not padded to {Vp} (a multiple of the split {multiple}): the pad pass "
             f"cannot follow node {e}; the vocabulary-sized weights stay replicated", AutoshardWarning)
        return cap
    new.graph.lint()
    new.recompile()
    return dataclasses.replace(cap, module=new, padding=tuple(padding))


def pad_widths(cap: Captured, multiple: int, *, heads: int | None = None, kv_heads: int | None = None,
               storage: int = 0, copies: bool = True) -> Captured:
    """``cap`` with every Linear whose out features the split ``multiple`` does not cut
    into whole units (heads, or single features: an intermediate size) padded with zero
    units to the next multiple, exactly (docs/design.md, "Uneven widths"). Rank ``r`` then
    holds ``⌈n/t⌉`` units of which the first ``n - r⌈n/t⌉`` (at most all) are real: the
    ``torch.chunk`` shares DTensor's uneven ``Shard`` gives each rank. The padding is
    followed through the graph (reshapes to heads, rotary, attention) to the Linear that
    contracts over it, whose weight gets zero columns. With grouped-query attention
    (``kv_heads`` < ``heads``) a query head is padded with its kv head's group. A family of
    widths the walk cannot follow to its contraction without a trim stays as it was
    (held whole by the planner, exact). ``storage``: the weights' out-feature split where it
    goes further (3d: ``q²``); a unit ``u`` wide pads to ``lcm(multiple, storage / gcd(u, storage))``.
    ``copies=False``: kv heads fewer than the split are left as they are. In 3d (``storage``
    ``q²``) each of the ``q`` slots holding a kv head's copy is stored split ``q`` ways more.

    >>> import transformers
    >>> from autoshard.passes.capture import capture
    >>> m = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=48, intermediate_size=96,
    ...     num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3, vocab_size=64))
    >>> cap = pad_widths(capture(m), 2, heads=3, kv_heads=3)
    >>> sorted((p.names[0].split(".")[-2], p.dense, p.padded) for p in cap.padding)[:3]
    [('k_proj', 48, 64), ('o_proj', 48, 64), ('q_proj', 48, 64)]
    """
    if multiple <= 1:
        return cap
    done = frozenset(n for p in cap.padding for n in p.names)
    r = multiple // kv_heads if heads and kv_heads and kv_heads < multiple and multiple % kv_heads == 0 and \
        heads % kv_heads == 0 and copies else 0
    for copying in ((True, False) if r else (False,)):
        seeds = _seeds(cap.module, multiple, heads, kv_heads, done, r if copying else 0, storage, copies)
        out = _pad_seeds(cap, seeds, multiple)
        if out is None:
            return cap
        if not copying or any(p.copies for p in out.padding):
            return out
    return out


def _seeds(gm: fx.GraphModule, multiple: int, heads, kv_heads, done, r: int, storage: int, copies: bool) -> dict:
    """The padded dim of every Linear weight (and bias) whose out features ``multiple``
    does not cut into whole units; with ``r`` > 0 (kv heads fewer than the split, ``r``
    ranks per kv head) the k/v projections hold ``r`` copies of each kv head and each kv
    head's query group is padded to ``r`` blocks of ``⌈g/r⌉`` query heads."""
    seeds: dict[str, _Dim] = {}
    params = dict(gm.named_parameters(remove_duplicate=False))      # _len_users of every parameter, at once
    readers = Counter(id(params.get(n.target)) for n in gm.graph.find_nodes(op="get_attr"))
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in LINEAR_OPS:
            continue
        xp, wp, bp, nd, _ = linear_operands(node)
        w = node.args[wp[0]]
        if not (isinstance(w, fx.Node) and w.op == "get_attr") or _val(w).dim() != 2 or w.target in done or \
                w.target in seeds or readers[id(params.get(w.target))] != 1:
            continue
        N = int(_val(w).shape[nd])
        segs, unit = _layout(node)
        if N % (segs * unit):
            continue
        n, hd = N // (segs * unit), unit
        if r and segs == 1 and unit > 1 and n in (heads, kv_heads):
            if storage and (multiple * unit) % storage:
                continue    # a copy's features would not split ``storage / multiple`` ways (3d: q² over q)
            g = heads // kv_heads
            if n == kv_heads:       # a kv head held by the r ranks whose query heads read it
                p = _Dim(nd, 1, r, unit, kv_heads, zero=False, copies=True, fan=-(-g // r))
            else:                   # each kv head's query group: r blocks of ⌈g/r⌉ query heads
                p = _Dim(nd, g, r * -(-g // r), unit, kv_heads)
        else:
            if heads and kv_heads and kv_heads < heads and heads % kv_heads == 0 and n == heads and unit > 1:
                n, unit = kv_heads, unit * (heads // kv_heads)      # a query head stays with its kv head
            if not copies and unit > 1 and kv_heads and n == kv_heads < multiple:
                continue        # no copies asked for, and groups would multiply the query heads
            m = math.lcm(multiple, storage // math.gcd(unit, storage)) if storage else multiple
            if n % m == 0:       # (query heads that divide while their kv heads do not: padded by group)
                continue
            p = _Dim(nd, n, math.ceil(n / m) * m, unit, segs)
        p = dataclasses.replace(p, head=hd if hd > 1 else 0)
        seeds[w.target] = p
        b = node.args[bp[0]] if bp else None
        if isinstance(b, fx.Node) and b.op == "get_attr" and _val(b).dim() == 1 and readers[id(params.get(b.target))] == 1:
            seeds[b.target] = p.at(0)
    return seeds


def _pad_seeds(cap: Captured, seeds: dict[str, _Dim], multiple: int) -> Captured | None:
    """``cap`` with ``seeds`` padded and followed (families the walk must cut back left
    out, the rest padded again); None where the walk cannot follow an op at all."""
    gm = cap.module
    tied: dict[int, list[str]] = {}
    for name, q in gm.named_parameters(remove_duplicate=False):
        tied.setdefault(id(q), []).append(name)
    while seeds:
        new = copy_sharing(gm)
        for name, p in seeds.items():
            t = gm.get_parameter(name)
            grown = torch.nn.Parameter(_pad_tensor(t, p), requires_grad=t.requires_grad)
            for alias in tied[id(t)]:       # every name of a tied tensor (the graph may read it by one only)
                mod_path, _, attr = alias.rpartition(".")
                setattr(new.get_submodule(mod_path) if mod_path else new, attr, grown)
        padder = _Padder(new, dict(seeds), grow=True, fixed=_padded_dims(cap))
        try:
            padder.run()
        except _Unsupported as e:
            if e.family is not None:
                seeds = {k: p for k, p in seeds.items() if p.family != e.family}
                continue
            warn(f"widths not padded to the split {multiple}: the pad pass cannot follow node {e}; "
                 f"those weights stay whole", AutoshardWarning)
            return None
        bad = {p.family for p in padder.trims}
        if bad:         # a family the walk had to cut back: left out, the others padded again
            seeds = {k: p for k, p in seeds.items() if p.family not in bad}
            continue
        new.graph.lint()
        new.recompile()
        aliases: dict[int, list[str]] = {}
        for name, q in new.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(q), []).append(name)
        padding = [Padding(names=tuple(aliases[id(new.get_parameter(k))]), dim=p.dim, dense=p.segs * p.n * p.unit,
                           padded=p.size, segments=p.segs, copies=p.np if p.copies else 0,
                           unit=p.head or p.pu)
                   for k, p in [*seeds.items(), *padder.grown.items()] if p.n != p.np]
        return dataclasses.replace(cap, module=new, padding=tuple(cap.padding) + tuple(padding))
    return cap


def pad_hidden(cap: Captured, multiple: int, hidden: int | None, *, storage: int = 0) -> Captured:
    """``cap`` with its hidden size padded with zero columns to a multiple of ``multiple``
    (and of ``storage``, the split of the weights' out features where it goes further: 3d),
    where the mode splits the residual stream (2d, 2.5d, 3d). Seeds: the embedding tables'
    columns, the 1-D parameters of that size that are no Linear's bias (norm weights), and
    the Linears writing the stream (out features ``hidden``, not cut into heads); the walk
    grows the Linears reading it, and a mean over it (RMSNorm's) is scaled to the dense
    mean. Where anything cannot follow, the hidden size stays as it was (held whole).

    >>> import transformers
    >>> from autoshard.passes.capture import capture
    >>> m = transformers.MistralForCausalLM(transformers.MistralConfig(hidden_size=63, head_dim=16,
    ...     intermediate_size=96, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    >>> sorted({(p.dense, p.padded) for p in pad_hidden(capture(m), 2, 63).padding})
    [(63, 64)]
    """
    m = math.lcm(multiple, storage or multiple)
    if multiple <= 1 or not hidden or hidden % m == 0:
        return cap
    gm, hp = cap.module, -(-hidden // m) * m
    seeds: dict[str, _Dim] = {}
    biases = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in LINEAR_OPS:
            _, wp, bp, nd, _ = linear_operands(node)
            w, b = node.args[wp[0]], node.args[bp[0]] if bp else None
            biases.add(getattr(b, "target", None))
            if isinstance(w, fx.Node) and w.op == "get_attr" and _val(w).dim() == 2 and \
                    _val(w).shape[nd] == hidden and _layout(node) == (1, 1):
                seeds[w.target] = _Dim(nd, hidden, hp)
                if isinstance(b, fx.Node) and b.op == "get_attr":
                    seeds[b.target] = _Dim(0, hidden, hp)
        elif node.op == "call_function" and node.target == aten.embedding.default and \
                getattr(node.args[0], "op", None) == "get_attr" and _val(node.args[0]).shape[-1] == hidden:
            seeds[node.args[0].target] = _Dim(1, hidden, hp)
    for node in gm.graph.nodes:
        v = _val(node)
        if node.op == "get_attr" and node.target not in biases and isinstance(v, torch.Tensor) and \
                tuple(v.shape) == (hidden,):
            seeds[node.target] = _Dim(0, hidden, hp)
    # a weight whose heads (or vocabulary) are padded already takes the hidden size's zeros on its other dim
    # (ParamPlan.pad_extra); not twice on one dim
    dims = _padded_dims(cap)
    seeds = {k: p for k, p in seeds.items() if p.dim not in dims.get(k, ()) and _len_users(gm, k) <= 2}
    out = _pad_seeds(cap, seeds, m) if seeds else None
    return cap if out is None or len(out.padding) == len(cap.padding) else out
