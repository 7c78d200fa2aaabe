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

aten = torch.ops.aten

__all__ = ["Padding", "pad_vocab", "zero_padded"]


@dataclass(frozen=True)
class Padding:
    """Parameters (every name of each, tied ones included) padded on ``dim`` from
    ``dense`` to ``padded`` entries."""

    names: tuple[str, ...]
    dim: int
    dense: int
    padded: int


_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_CE = {aten.cross_entropy_loss.default}


class _Trim(Exception):
    """The node cannot take the padded value: give it the first ``V`` entries."""


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _same(a, b) -> bool:
    return str(a) == str(b)


def _is_pointwise(t) -> bool:
    return (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags
            and torch.Tag.nondeterministic_seeded not in t.tags) or t in (
        aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
        aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.to.device)


class _Padder:
    def __init__(self, gm: fx.GraphModule, V: int, Vp: int, params: dict[str, int]):
        self.gm, self.V, self.Vp = gm, V, Vp
        self.params = params                  # get_attr target -> padded dim
        self.padded: dict[fx.Node, int] = {}  # value -> its padded dim
        self.fake = detect_fake_mode([_val(n) for n in gm.graph.nodes if _val(n) is not None])

    # ------------------------------------------------------------ meta values
    def _refresh(self, node: fx.Node) -> None:
        if node.op == "get_attr":
            t = self.gm.get_parameter(node.target)
            node.meta["val"] = self.fake.from_tensor(t, static_shapes=True)
            return
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
        with self.fake:
            node.meta["val"] = node.target(*args, **kwargs)
        node.meta.pop("tensor_meta", None)

    def _insert(self, before: fx.Node, target, args) -> fx.Node:
        g = self.gm.graph
        with g.inserting_before(before):
            n = g.call_function(target, args)
        for k in ("nn_module_stack", "stack_trace"):
            if k in before.meta:
                n.meta[k] = before.meta[k]
        self._refresh(n)
        return n

    def _trim(self, node: fx.Node, arg: fx.Node) -> fx.Node:
        n = self._insert(node, aten.slice.Tensor, (arg, self.padded[arg], 0, self.V))
        n.meta[TRIM_META] = True
        return n

    def _mask(self, node: fx.Node, x: fx.Node) -> fx.Node:
        """``x`` with its padded entries on the last dim set to -inf."""
        v = _val(x)
        g = self.gm.graph
        with g.inserting_before(node):
            ar = g.call_function(aten.arange.default, (self.Vp,), {"dtype": torch.int64, "device": v.device})
        self._refresh(ar)
        pad = self._insert(node, aten.ge.Scalar, (ar, self.V))
        return self._insert(node, aten.masked_fill.Scalar, (x, pad, float("-inf")))

    # ------------------------------------------------------------ dim rules
    def _out_dim(self, node: fx.Node) -> int | None:
        """The padded dim of ``node``'s output (None: not padded); raises _Trim."""
        t, a = node.target, node.args
        pd = self.padded
        if t == aten.embedding.default:
            if a[1] in pd or pd.get(a[0]) != 0:
                raise _Trim
            return None
        if t in LINEAR_OPS:
            xp, wp, bp, nd, _ = linear_operands(node)
            x, w = a[xp[0]], a[wp[0]]
            b = a[bp[0]] if bp else None
            if x in pd or pd.get(w) != nd or (isinstance(b, fx.Node) and b in pd and pd[b] != 0):
                raise _Trim
            if isinstance(b, fx.Node) and b not in pd and _val(b) is not None and _val(b).dim():
                raise _Trim
            return _val(node).dim() - 1
        out = _val(node)
        if not isinstance(out, torch.Tensor):
            raise _Trim
        r = out.dim()
        if _is_pointwise(t):
            where = None
            for n in node.all_input_nodes:
                v = _val(n)
                if not isinstance(v, torch.Tensor):
                    continue
                if n in pd:
                    p = pd[n] + r - v.dim()
                    if where not in (None, p):
                        raise _Trim
                    where = p
            for n in node.all_input_nodes:
                v = _val(n)
                if n in pd or not isinstance(v, torch.Tensor):
                    continue
                q = where - (r - v.dim())
                if q >= 0 and not _same(v.shape[q], 1):
                    raise _Trim
            return where
        x = a[0]
        d = pd.get(x)
        if d is None:
            raise _Trim
        nx = _val(x).dim()
        if t in _VIEWS:
            s_in, s_out, shape = list(_val(x).shape), list(out.shape), list(a[1])
            tail = s_in[d + 1:]
            for e in range(len(s_out)):
                if (_same(s_out[e], self.V) and len(s_out) - e - 1 == len(tail)
                        and all(_same(p, q) for p, q in zip(s_out[e + 1:], tail))):
                    if shape[e] == self.V:
                        shape[e] = self.Vp
                    elif shape[e] != -1:
                        raise _Trim
                    node.args = (x, shape) + tuple(a[2:])
                    return e
            raise _Trim
        if t == aten.slice.Tensor:
            dim = (a[1] if len(a) > 1 else 0) % nx
            if dim == d:
                raise _Trim
            return d
        if t == aten.select.int:
            dim = a[1] % nx
            if dim == d:
                raise _Trim
            return d - (dim < d)
        if t == aten.t.default:
            return 1 - d if nx == 2 else d
        if t == aten.transpose.int:
            i, j = a[1] % nx, a[2] % nx
            return j if d == i else i if d == j else d
        if t == aten.permute.default:
            return [p % nx for p in a[1]].index(d)
        if t == aten.unsqueeze.default:
            return d + ((a[1] % (nx + 1)) <= d)
        raise _Trim

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
        if node.target in _CE:
            x = node.args[0]
            if node.args[1] not in self.padded and self.padded.get(x) == 1 and _val(x).dim() == 2:
                node.args = (self._mask(node, x),) + tuple(node.args[1:])
                self._refresh(node)
                return
        if node.target is operator.getitem:
            raise _Unsupported(f"{node.format_node()} takes a padded multi-output value")
        try:
            d = self._out_dim(node)
        except _Trim:
            node.args, node.kwargs = fx.map_arg(
                (node.args, node.kwargs), lambda n: self._trim(node, n) if n in self.padded else n)
            d = None
        self._refresh(node)
        if d is not None:
            self.padded[node] = d


class _Unsupported(Exception):
    pass


def _vocab_params(gm: fx.GraphModule, vocab: int | None = None) -> tuple[int, dict[int, tuple[torch.nn.Parameter, int]]] | None:
    """The vocabulary size ``V`` and the parameters holding it: its embedding table (dim
    0), Linear weights with ``V`` output features and their biases, by ``id``. The table
    is the one with ``vocab`` rows where the caller knows it (None if there is none),
    else the largest table a Linear projects back onto (the LM head), else the largest
    table (a tiny GPT-2's position table can outgrow its vocabulary)."""
    embs = [(_val(n.args[0]).numel(), n.args[0].target) for n in gm.graph.nodes
            if n.op == "call_function" and n.target == aten.embedding.default
            and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr"]
    if not embs:
        return None
    rows = {e: int(gm.get_parameter(e[1]).shape[0]) for e in embs}
    if vocab is not None:
        headed = [e for e in embs if rows[e] == vocab]
        if not headed:
            return None
    else:
        outs = set()
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target in LINEAR_OPS:
                _, wp, _, nd, _ = linear_operands(n)
                w = _val(n.args[wp[0]])
                if isinstance(w, torch.Tensor) and w.dim() == 2:
                    outs.add(int(w.shape[nd]))
        headed = [e for e in embs if rows[e] in outs]
    table = gm.get_parameter(max(headed or embs)[1])
    V = table.shape[0]
    found = {id(table): (table, 0)}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in LINEAR_OPS:
            continue
        _, wp, bp, nd, _ = linear_operands(n)
        w = n.args[wp[0]]
        if not (isinstance(w, fx.Node) and w.op == "get_attr") or _val(w).dim() != 2 or _val(w).shape[nd] != V:
            continue
        wt = gm.get_parameter(w.target)
        found.setdefault(id(wt), (wt, nd))
        b = n.args[bp[0]] if bp else None
        if isinstance(b, fx.Node) and b.op == "get_attr":
            bt = gm.get_parameter(b.target)
            found.setdefault(id(bt), (bt, 0))
    return V, found


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
    padder = _Padder(new, V, Vp, {n.target: targets[n.target] for n in new.graph.nodes
                                  if n.op == "get_attr" and n.target in targets})
    try:
        padder.run()
    except _Unsupported as e:           # the vocabulary stays whole (replicated, exact), as without padding
        warn(f"the vocabulary {V} is not padded to {Vp} (a multiple of the split {multiple}): the pad pass "
             f"cannot follow node {e}; the vocabulary-sized weights stay replicated", AutoshardWarning)
        return cap
    new.graph.lint()
    new.recompile()
    return dataclasses.replace(cap, module=new, padding=tuple(padding))
