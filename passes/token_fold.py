"""Per-token ops over flattened tokens, rewritten to keep the token dims apart.

A graph flattens ``[batch, sequence, features]`` into ``[tokens, features]`` before
some per-token ops: GPT-2's Conv1D (``view → addmm → view``) and the causal-LM loss
(``cross_entropy_loss(logits.view(-1, V), labels.view(-1))``). With the sequence
split over ``cp`` (context parallelism) and the batch whole, the merged token dim
holds each rank's tokens interleaved with the others' — no block layout describes it,
and the planner would gather the sequence first. This pass (run only where the mesh
has a ``cp`` axis) computes the same values without the merge:

- ``view(addmm(b, view(x, [-1, k]), W), x.shape[:-1] + [n])`` → ``add(matmul(x, W), b)``:
  a Linear on the unflattened tokens (its rules then apply as to any ``matmul`` with a
  parameter operand);
- ``cross_entropy_loss(view(x, [-1, V]), view(t, [-1]), ...)`` →
  :func:`autoshard.ir.tokens.token_cross_entropy` ``(x, t, ...)``, which flattens locally;
- ``slice(conv1d(x, W, b, stride 1, padding p), -1, 0, T)`` of an ``x`` ``[B, C, T]`` whose
  time dim is symbolic (LFM2's causal convolution: both ends padded, the first ``T``
  kept) → :func:`autoshard.ir.tokens.sequence_conv` ``(x, W, b, p, d·(k-1) - p, d, g)``,
  whose output keeps the sequence's length, so a cp split passes through it.

All three are matched on ATen ops and shapes only.

>>> import torch, transformers
>>> from autoshard.passes.capture import capture
>>> cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
>>> cap = capture(transformers.GPT2LMHeadModel(cfg))
>>> g = fold_token_flattens(cap).module.graph
>>> from autoshard.ir.tokens import token_cross_entropy
>>> sum(n.target == torch.ops.aten.addmm.default for n in g.nodes), sum(n.target is token_cross_entropy for n in g.nodes)
(0, 1)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from autoshard.ir.tokens import sequence_conv, token_cross_entropy

from .capture import Captured, copy_sharing

__all__ = ["fold_token_flattens"]

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _shape(n) -> tuple | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _flattened(n) -> fx.Node | None:
    """``x`` where ``n`` is ``view(x, [-1, last])`` of an ``x`` with 3 or more dims (tokens merged), else None."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target in _VIEWS):
        return None
    x, sx, sn = n.args[0], _shape(n.args[0]), _shape(n)
    if sx is None or sn is None or len(sx) < 3 or len(sn) != 2 or sn[1] != sx[-1]:
        return None
    return x


_SAME_VALUES = (aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.contiguous.default,
                aten.alias.default)


def _flattened_rows(n, lead: tuple) -> fx.Node | None:
    """``t`` where ``n`` is ``view(t, [-1])`` of a ``t`` shaped ``lead`` (through copies that
    keep its values: ``labels.view(-1).to(device)``), else None."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _SAME_VALUES and \
            getattr(n.meta.get("val"), "dtype", None) == getattr(n.args[0].meta.get("val"), "dtype", 0):
        n = n.args[0]
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target in _VIEWS):
        return None
    t = n.args[0]
    return t if _shape(t) == lead and len(_shape(n) or ()) == 1 else None


def _conv1d(n) -> tuple | None:
    """``(x, W, b)`` where ``n`` is ``view(addmm(b, view(x, [-1, k]), W), x.shape[:-1] + (n,))``."""
    if not (n.op == "call_function" and n.target in _VIEWS):
        return None
    mm = n.args[0]
    if not (isinstance(mm, fx.Node) and mm.target == aten.addmm.default and len(mm.users) == 1 and not mm.kwargs
            and len(mm.args) == 3):
        return None
    b, flat, w = mm.args
    x = _flattened(flat)
    if x is None or len(flat.users) != 1 or _shape(n) != _shape(x)[:-1] + (_shape(mm)[-1],):
        return None
    return x, w, b


def _same(a, b) -> bool:
    """Two sizes, symbolic or not, known equal (a symbolic size compared by its expression)."""
    return str(a) == str(b)


def _seq_conv(n) -> tuple | None:
    """``(x, W, b, left, right, dilation, groups)`` where ``n`` is ``slice(conv1d(x, ...), -1, 0, T)``
    keeping the first ``T`` outputs of a stride-1 padded convolution of an ``x`` ``[B, C, T]`` over a
    symbolic ``T``; else None."""
    if not (n.op == "call_function" and n.target == aten.slice.Tensor and not n.kwargs):
        return None
    a = list(n.args) + [0, None, None, 1][len(n.args) - 1:]
    conv, dim, start, _, step = a[:5]
    if not (isinstance(conv, fx.Node) and conv.op == "call_function" and conv.target == aten.conv1d.default
            and len(conv.users) == 1 and not conv.kwargs and dim in (2, -1) and start in (None, 0) and step == 1):
        return None
    c = list(conv.args) + [None, [1], [0], [1], 1][len(conv.args) - 2:]
    x, w, b, stride, pad, dil, groups = c[:7]
    sx, sw, sn = _shape(x), _shape(w), _shape(n)
    if sx is None or sw is None or len(sx) != 3 or isinstance(sx[-1], int) or not isinstance(pad, (list, tuple)) \
            or list(stride) != [1] or len(pad) != 1 or len(dil) != 1 or not isinstance(pad[0], int):
        return None
    reach = dil[0] * (sw[-1] - 1)
    if not (sn is not None and len(sn) == 3 and all(_same(p, q) for p, q in zip(sn, sx[:1] + (sw[0], sx[2])))
            and 0 <= pad[0] <= reach):
        return None
    return x, w, b, pad[0], reach - pad[0], dil[0], groups


def fold_token_flattens(cap: Captured) -> Captured:
    """``cap`` with its token flattens folded (see the module doc); ``cap`` itself where
    there is none. ``cap`` is not changed: the result holds a copy of the graph module
    sharing every parameter."""
    def ce(n):
        if n.op != "call_function" or n.target != aten.cross_entropy_loss.default or len(n.args) < 2 or n.kwargs:
            return None
        x = _flattened(n.args[0])
        t = _flattened_rows(n.args[1], _shape(x)[:-1]) if x is not None else None
        return (x, t) if t is not None else None

    if not any(n.op == "call_function" and (_conv1d(n) or ce(n) or _seq_conv(n)) for n in cap.module.graph.nodes):
        return cap
    gm = copy_sharing(cap.module)
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        found = _conv1d(n)
        if found is not None:
            x, w, b = found
            with g.inserting_before(n):
                mm = g.call_function(aten.matmul.default, (x, w))
                mm.meta = {"val": n.meta["val"]}
                r = g.call_function(aten.add.Tensor, (mm, b))
        elif (pair := ce(n)) is not None:
            with g.inserting_before(n):
                r = g.call_function(token_cross_entropy, pair + tuple(n.args[2:]))
        elif (conv := _seq_conv(n)) is not None:
            with g.inserting_before(n):
                r = g.call_function(sequence_conv, conv)
        else:
            continue
        r.meta = dict(n.meta)
        n.replace_all_uses_with(r)
        g.erase_node(n)
    _erase_unused(g)
    g.lint()
    gm.recompile()
    return dataclasses.replace(cap, module=gm)


def _erase_unused(g: fx.Graph) -> None:
    """Drop the views and products the folds left without users (pure ops only)."""
    changed = True
    while changed:
        changed = False
        for n in reversed(list(g.nodes)):
            if n.op == "call_function" and (n.target in _VIEWS + _SAME_VALUES + (aten.addmm.default,
                                                                                 aten.conv1d.default)) and \
                    all(u.target == aten._assert_tensor_metadata.default for u in n.users):
                for u in list(n.users):
                    g.erase_node(u)
                g.erase_node(n)
                changed = True
