"""Re-layouts: the steps that turn a value's layout into the one an op asks of it
(a pass over the walk's result, docs/design.md, "The propagation passes").

Requires the walk's :class:`~autoshard.passes.walked.Walked` (every value's final
layout, and per node the layouts its choice asks of its inputs); ensures each
:class:`~autoshard.passes.walked.Visit` has its ``arg_steps`` (reduce partials, then
gather, then slice: :func:`redistribute`) and the outputs their gathers to full
(``output_steps``). A re-layout that would move rows a sort put in a rank-local order
is refused (:mod:`.row_order`).
"""

from __future__ import annotations

import dataclasses

from torch import fx

from autoshard.ir.argpath import get_arg
from autoshard.ir.errors import ShardingError
from autoshard.ir.mesh import Mesh
from autoshard.ir.plan import Step
from autoshard.ir.spec import ShardSpec
from autoshard.policies.base import Choice

from .walked import Visit, Walked, evolve

__all__ = ["before_cuts", "redistribute", "relayouts"]


def relayouts(walked: Walked) -> Walked:
    """``walked`` with each visit's re-layout steps (``arg_steps``, in the order the
    choice lists its inputs) and the outputs' gathers (``output_steps``)."""
    return walked.with_visits(lambda v: _visit_steps(walked, v), output_steps=_output_steps(walked))


def _visit_steps(walked: Walked, v: Visit) -> Visit:
    arg_steps = []
    for path in v.moves:
        steps = _relayout(walked, v.node, get_arg(v.node, path), v.in_specs[path])
        if steps:
            arg_steps.append((path, tuple(steps)))
    return evolve(v, arg_steps=tuple(arg_steps))


def _relayout(walked: Walked, node, a: fx.Node, req: ShardSpec) -> list[Step]:
    """Steps from ``a``'s layout to ``req``; refused where they would move rows that
    a sort put in a rank-local order."""
    cur = walked.spec(a)
    steps = redistribute(cur, req, walked.mesh)
    if steps and cur.ndim and req.ndim and cur.dims[0] != req.dims[0] \
            and walked.row_fact(a).order is not None:
        raise ShardingError(f"input {a.name} holds its rows in a rank-local order (sorted on each rank's "
                            f"own tokens); re-laying its rows from {cur.dims[0] or 'whole'} to "
                            f"{req.dims[0] or 'whole'} would mix the ranks' orders", node=node)
    return steps


def _output_steps(walked: Walked) -> tuple:
    """(arg path, steps) gathering each split output to full, less the dp split (dp
    replicas keep their own rows); nothing when the outputs stay split."""
    node = walked.output
    if node is None or not walked.gather_outputs:
        return ()
    flat = node.args[0]
    items = list(flat) if isinstance(flat, (list, tuple)) else [flat]
    out = []
    for i, a in enumerate(items):
        if not isinstance(a, fx.Node):
            continue
        s = walked.specs.get(a.name)
        if not isinstance(s, ShardSpec) or s.is_replicated:
            continue
        keep = ShardSpec(dims=tuple(tuple(x for x in d if x in walked.dp_axes) for d in s.dims))
        steps = redistribute(s, keep, walked.mesh)
        if steps:
            out.append(((0, i), tuple(steps)))
    return tuple(out)


def before_cuts(choice: Choice):
    """``choice.out`` as the op itself makes it: the dims its ``scatter`` post-steps cut, whole.

        >>> from autoshard.ir.spec import replicated
        >>> c = Choice(out=replicated(2).with_dim(1, ("cp",)), post=(Step(op="scatter", axes=("cp",), dim=1),))
        >>> before_cuts(c) == replicated(2)
        True
    """
    out = choice.out
    for st in choice.post:
        if st.op == "scatter" and isinstance(out, ShardSpec):
            out = out.with_dim(st.dim, ())
    return out


def redistribute(cur: ShardSpec, req: ShardSpec, mesh: Mesh) -> list[Step]:
    """Steps that turn layout ``cur`` into ``req``: reduce partials (reduce-scatter
    when ``req`` splits a dim over exactly those axes), then gather, then slice.

        >>> from autoshard.ir.spec import replicated
        >>> [st.op for st in redistribute(replicated(2).with_dim(1, ("tp",)), replicated(2), Mesh(axes=("tp",), sizes=(2,)))]
        ['gather']
    """
    if cur is None or req is None:
        return []
    if cur == req:
        return []
    steps: list[Step] = []
    s = cur
    if s.partial and tuple(s.partial) != tuple(req.partial):
        p = s.partial
        rs_dim = next((d for d in range(req.ndim) if req.dims[d] == p and not s.dims[d]), None)
        if rs_dim is not None and req.segments[rs_dim] == 1:
            steps.append(Step(op="reduce_scatter", axes=p, dim=rs_dim))
            s = s.with_partial(()).with_dim(rs_dim, p)
        else:
            steps.append(Step(op="reduce_from", axes=p))
            s = s.with_partial(())
    for d in range(s.ndim):
        have, want = s.dims[d], req.dims[d]
        if have and (have != want or _fused(s, d) != _fused(req, d)):
            # gathering only the inner axes keeps the outer block: (dp,row) -> (dp,)
            keep = want if (want and have[:len(want)] == want and _fused(s, d) == _fused(req, d)) else ()
            steps.append(Step(op="gather", axes=have[len(keep):], dim=d, segments=_fused(s, d)))
            s = s.with_dim(d, keep, s.segments[d])
    for d in range(s.ndim):
        have, want = s.dims[d], req.dims[d]
        if want and have != want:
            # have is () or a prefix of want: slice the inner axes locally
            steps.append(Step(op="scatter", axes=want[len(have):], dim=d, segments=_fused(req, d)))
            s = s.with_dim(d, want, req.segments[d], req.widths[d] if req.widths else ())
    return steps


def _fused(s: ShardSpec, d: int):
    """Dim ``d``'s fused blocks as a :class:`Step` carries them: their count, or the relative
    widths of unequal ones (``ShardSpec.widths``)."""
    return s.widths[d] if s.widths and s.widths[d] else s.segments[d]

