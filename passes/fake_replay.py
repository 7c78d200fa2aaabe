"""An op re-run on a graph's fake values, remembered: the pad pass (:mod:`.pad`) recomputes a
node's ``meta["val"]`` after it widens an operand, and a search pads the same shallow graphs
for every layout it prices, running the same ops on the same symbolic shapes each time
(docs/design.md, "Pricing the search").

An op that makes new tensors only (no view, no in-place write) is keyed by its target, the
fake mode, and its operands' geometry (symbolic sizes and strides as their expressions,
dtype, device, ``requires_grad``) and other arguments; a repeat builds outputs of the
remembered geometry with ``empty_strided`` in the same fake mode instead of running the
op's decomposition. An op whose outputs carry a symbol its operands do not (a
data-dependent size) is always run.
"""

from __future__ import annotations

import torch

__all__ = ["makes_new_tensors", "makes_view", "run_fake"]

#: (target, id(fake mode), operand key) -> (fake mode, record) or (fake mode, None): not replayable
_MEMO: dict = {}
_MEMO_MAX = 50_000
#: the fake modes ``_MEMO`` holds (a mode keeps its graph's fake values alive: a few at most)
_MODES: dict = {}
_MODES_MAX = 4
#: how many runs were replayed and how many ran (what tests/passes/test_fake_replay.py reads)
STATS = {"replayed": 0, "ran": 0}
_NEW_ONLY: dict = {}


def makes_new_tensors(target) -> bool:
    """An ATen overload whose schema neither writes an operand nor returns a view of one.

        >>> makes_new_tensors(torch.ops.aten.mm.default), makes_new_tensors(torch.ops.aten.view.default)
        (True, False)
    """
    ok = _NEW_ONLY.get(target)
    if ok is None:
        schema = getattr(target, "_schema", None) if isinstance(target, torch._ops.OpOverload) else None
        ok = _NEW_ONLY[target] = schema is not None and not schema.is_mutable and \
            all(r.alias_info is None for r in schema.returns)
    return ok


def _size(s, syms: set):
    if isinstance(s, torch.SymInt):
        expr = s.node.expr
        syms |= expr.free_symbols
        return ("s", expr)
    if isinstance(s, int):
        return s
    raise TypeError("not a size")


def _key(v, syms: set):
    if isinstance(v, torch.Tensor):
        return ("T", tuple(_size(s, syms) for s in v.shape), tuple(_size(s, syms) for s in v.stride()),
                _size(v.storage_offset(), syms), v.dtype, v.device, v.requires_grad)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_key(x, syms) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((k, _key(x, syms)) for k, x in sorted(v.items())))
    if isinstance(v, torch.SymInt):
        return ("SymInt", _size(v, syms))
    if isinstance(v, (torch.SymFloat, torch.SymBool)):
        raise TypeError("symbolic scalar")
    hash(v)
    return (type(v).__name__, v)


def _record(out, syms: set):
    """``(structure, geometry per output)`` of a run, or None where a replay could not
    rebuild it (not tensors, an offset output, a size symbol the operands do not have)."""
    outs = [out] if isinstance(out, torch.Tensor) else list(out) if type(out) in (list, tuple) else None
    if not outs or not all(isinstance(t, torch.Tensor) for t in outs):
        return None
    geo = []
    for t in outs:
        if not isinstance(t.storage_offset(), int) or t.storage_offset():
            return None
        mine: set = set()
        for s in (*t.shape, *t.stride()):
            if isinstance(s, torch.SymInt):
                mine |= s.node.expr.free_symbols
        if not mine <= syms:
            return None
        geo.append((tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad))
    return (None if isinstance(out, torch.Tensor) else type(out), tuple(geo))


def makes_view(target) -> bool:
    """An ATen overload that returns one view of its first operand and writes nothing
    (``view``, ``transpose``, ``slice``, ``expand``; ``reshape`` and ``contiguous`` may
    copy or return the operand itself instead: :func:`run_fake` replays only a run that
    made a view).

        >>> makes_view(torch.ops.aten.transpose.int), makes_view(torch.ops.aten.mm.default)
        (True, False)
    """
    ok = _VIEW_ONLY.get(target)
    if ok is None:
        schema = getattr(target, "_schema", None) if isinstance(target, torch._ops.OpOverload) else None
        ok = _VIEW_ONLY[target] = schema is not None and not schema.is_mutable and len(schema.returns) == 1 \
            and bool(schema.arguments) and schema.arguments[0].alias_info is not None \
            and schema.returns[0].alias_info is not None and str(schema.returns[0].type) == "Tensor" \
            and schema.returns[0].alias_info.before_set == schema.arguments[0].alias_info.before_set
    return ok


_VIEW_ONLY: dict = {}


def _record_view(out, base, syms: set):
    """``("view", shape, stride, offset)`` of a run that made a view of ``base``, or None
    (a copy, the operand itself, another dtype, a size symbol ``base`` does not have)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    if not isinstance(out, torch.Tensor) or out is base or out.dtype != base.dtype or not out._is_view() or \
            StorageWeakRef(out.untyped_storage()) != StorageWeakRef(base.untyped_storage()):
        return None
    mine: set = set()
    for s in (*out.shape, *out.stride(), out.storage_offset()):
        if isinstance(s, torch.SymInt):
            mine |= s.node.expr.free_symbols
    return ("view", tuple(out.shape), tuple(out.stride()), out.storage_offset()) if mine <= syms else None


def _replay_view(fake, base, rec):
    """The view ``rec`` of ``base`` again (``as_strided`` at the remembered sizes, strides and
    offset: the view op's shape inference on symbolic sizes not re-run); None where that fails."""
    _, shape, stride, offset = rec
    try:
        with fake:
            return torch.ops.aten.as_strided.default(base, shape, stride, offset)
    except Exception:  # noqa: BLE001 - the caller runs the op itself
        return None


def run_fake(fake, target, args, kwargs):
    """``target(*args, **kwargs)`` in fake mode ``fake``, replayed where the same op ran on
    operands of the same geometry before (see the module doc)."""
    if makes_view(target) and args and isinstance(args[0], torch.Tensor):
        return _run_view(fake, target, args, kwargs)
    if not makes_new_tensors(target):
        with fake:
            return target(*args, **kwargs)
    syms: set = set()
    try:
        key = (target, id(fake), _key(args, syms), _key(kwargs, syms))
    except TypeError:
        with fake:
            return target(*args, **kwargs)
    hit = _MEMO.get(key)
    if hit is not None and hit[0] is fake and hit[1] is not None:
        structure, geo = hit[1]
        STATS["replayed"] += 1
        with fake:
            made = [torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(grad)
                    for shape, stride, dtype, device, grad in geo]
        return made[0] if structure is None else structure(made)
    STATS["ran"] += 1
    with fake:
        out = target(*args, **kwargs)
    if hit is None:
        _remember(fake, key, _record(out, syms))
    return out


def _run_view(fake, target, args, kwargs):
    """:func:`run_fake` of a view op: keyed like an op making new tensors (and by grad mode,
    which the view's ``requires_grad`` follows), a repeat rebuilt from the remembered view."""
    syms: set = set()
    try:
        key = ("view", target, id(fake), torch.is_grad_enabled(), _key(args, syms), _key(kwargs, syms))
    except TypeError:
        with fake:
            return target(*args, **kwargs)
    hit = _MEMO.get(key)
    if hit is not None and hit[0] is fake and hit[1] is not None:
        out = _replay_view(fake, args[0], hit[1])
        if out is not None:
            STATS["replayed"] += 1
            return out
    STATS["ran"] += 1
    with fake:
        out = target(*args, **kwargs)
    if hit is None:
        _remember(fake, key, _record_view(out, args[0], syms))
    return out


def _remember(fake, key, rec) -> None:
    if len(_MEMO) >= _MEMO_MAX or (id(fake) not in _MODES and len(_MODES) >= _MODES_MAX):
        _MEMO.clear()
        _MODES.clear()
    _MODES[id(fake)] = fake
    _MEMO[key] = (fake, rec)      # the mode kept alive: its id stays its own
