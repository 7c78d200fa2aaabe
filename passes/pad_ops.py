"""What the pad pass (:mod:`autoshard.passes.pad`) reads of the graph: a node's fake
value, whether a pointwise op keeps zeros zero, ratios of (symbolic) sizes, the
parameters holding the vocabulary, how many nodes read a parameter and how a Linear's
out features are laid out (fused blocks, heads).

    >>> size_ratio(12, 4), size_ratio(4, 12)
    (3, None)
"""

from __future__ import annotations

import functools
import math
import operator

import torch
from torch import fx

from autoshard.policies.linear_ops import linear_operands

from .annotate import LINEAR_OPS

aten = torch.ops.aten

__all__ = ["SPLITS", "VIEWS", "is_pointwise", "keeps_zero", "len_users", "node_val", "out_layout", "same_size",
           "size_ratio", "vocab_params"]

VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}


def node_val(n):
    """The fake value export recorded for the node ``n`` (None for a non-node or none recorded)."""
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def same_size(a, b) -> bool:
    """Whether two sizes, plain or symbolic, are the same expression."""
    return str(a) == str(b)


def is_pointwise(t) -> bool:
    """Whether the op ``t`` works entry by entry (a pointwise ATen op, a copy or a cast)."""
    return (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags
            and torch.Tag.nondeterministic_seeded not in t.tags) or t in (
        aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
        aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.to.device)


def keeps_zero(node: fx.Node, zero: set) -> bool:
    """Whether the pointwise ``node`` gives 0 where its operands in ``zero`` are 0,
    whatever its other operands hold: tried on scalars."""
    for seed in (0.37, -1.9):
        def rep(a):
            v = node_val(a)
            if not isinstance(v, torch.Tensor):
                return a
            if a in zero:
                return torch.zeros((), dtype=v.dtype)
            return torch.full((), seed, dtype=torch.float32).to(v.dtype)
        args, kwargs = fx.map_arg((node.args, node.kwargs), rep)
        kwargs = {k: v for k, v in kwargs.items() if k != "device"}
        try:
            out = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - an op that takes no scalars: not known to keep zeros
            return False
        if not isinstance(out, torch.Tensor) or out.ne(0).any():
            return False
    return True


def size_ratio(a, b) -> int | None:
    """``a / b`` where it is a positive whole number (sizes may be symbolic), else None."""
    import sympy

    if isinstance(a, int) and isinstance(b, int):
        return a // b if b and a % b == 0 and a // b > 0 else None
    ea, eb = (x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(int(x)) for x in (a, b))
    return _ratio(ea, eb)


@functools.lru_cache(maxsize=10_000)
def _ratio(ea, eb) -> int | None:
    # remembered by the two expressions: sympy.simplify took a quarter of the pad pass, which a
    # search runs on the same shallow graph's reshapes for every width it prices
    import sympy

    r = sympy.simplify(ea / eb)
    return int(r) if r.is_Integer and r > 0 else None


def vocab_params(gm: fx.GraphModule, vocab: int | None = None) -> tuple[int, dict[int, tuple[torch.nn.Parameter, int]]] | None:
    """The vocabulary size ``V`` and the parameters holding it: its embedding table (dim
    0), Linear weights with ``V`` output features and their biases, by ``id``. The table
    is the one with ``vocab`` rows where the caller knows it (None if there is none),
    else the largest table a Linear projects back onto (the LM head), else the largest
    table (a tiny GPT-2's position table can outgrow its vocabulary)."""
    embs = [(node_val(n.args[0]).numel(), n.args[0].target) for n in gm.graph.nodes
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
                w = node_val(n.args[wp[0]])
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
        if not (isinstance(w, fx.Node) and w.op == "get_attr") or node_val(w).dim() != 2 or node_val(w).shape[nd] != V:
            continue
        wt = gm.get_parameter(w.target)
        found.setdefault(id(wt), (wt, nd))
        b = n.args[bp[0]] if bp else None
        if isinstance(b, fx.Node) and b.op == "get_attr":
            bt = gm.get_parameter(b.target)
            found.setdefault(id(bt), (bt, 0))
    return V, found


def len_users(gm: fx.GraphModule, target: str) -> int:
    """How many get_attr nodes read the parameter ``target`` (or a tied name of it)."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    p = params.get(target)
    return sum(1 for n in gm.graph.nodes if n.op == "get_attr" and params.get(n.target) is p)


def out_layout(node: fx.Node) -> tuple[int, int]:
    """``(segments, unit)`` of a Linear's out features, from what its output meets on its
    way: a split into equal blocks on the last dim (a fused q, k, v: segments) and a
    reshape cutting the last dim into ``[..., units, unit]`` (heads of ``unit`` features);
    ``(1, 1)`` where neither comes (an MLP's intermediate features)."""
    cur, segs = node, 1
    for _ in range(16):
        users = [u for u in cur.users if u.target not in (aten._assert_tensor_metadata.default, aten.sym_size.int)]
        v = node_val(cur)
        if len(users) != 1 or not isinstance(v, torch.Tensor) or not v.dim():
            break
        u, last = users[0], v.shape[-1]
        if u.target in VIEWS:
            out = list(node_val(u).shape)
            # (not [.., 1, hd]: that is one head)
            if out and same_size(out[-1], last) and not (len(out) > v.dim() and same_size(out[-2], 1)):
                cur = u
                continue
            for k in range(2, len(out) + 1):
                if same_size(math.prod(out[-k:]), last):
                    return segs, math.prod(out[-k + 1:])
            break
        if u.target in SPLITS and segs == 1:
            nd = v.dim()
            dim = (u.args[2] if len(u.args) > 2 else 0) % nd
            parts = [g for g in u.users if g.target is operator.getitem]
            sizes = [node_val(g).shape[dim] for g in parts]
            if dim != nd - 1 or len(parts) < 2 or len({str(x) for x in sizes}) != 1:
                break
            segs, cur = len(parts), min(parts, key=lambda g: g.args[1])
            continue
        if is_pointwise(u.target) and len(u.all_input_nodes) == 1:
            cur = u
            continue
        break
    return segs, 1
