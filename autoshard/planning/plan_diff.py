"""What changes between two plans of one model: per node, per parameter, and overall.

For people choosing between candidates (``1d`` on 8 ranks or ``2.5d`` with d = 2?):
:func:`diff` matches the nodes of two :class:`~autoshard.ir.plan.ShardingPlan` by name
(plans of the same model share the captured graph, so its node names) and reports
each node whose kernel, output spec, per-rank shape, weight slice, collectives,
parameter bytes or communication bytes differ, the nodes only one plan has, the
parameters whose spec changed, and the plan-level figures (mode, mesh, axes,
bytes per rank). :func:`table` prints it; ``autoshard diff A.json B.json`` is the
command line.

    >>> from autoshard.ir.mesh import Mesh
    >>> from autoshard.ir.plan import NodePlan, ShardingPlan
    >>> def toy(mode, weight):
    ...     n = NodePlan(name="linear", op="linear", kind="linear", module="fc", out_spec=None, weight=weight)
    ...     return ShardingPlan(model="toy", mode=mode, mesh=Mesh(axes=("tp",), sizes=(2,)), tp_axes=("tp",),
    ...                         batch_axes=(), batch_size=1, seq_len=1, nodes=(n,), params=())
    >>> [(c.what, c.name, c.status, [f for f, _, _ in c.fields]) for c in diff(toy("1d", "column"), toy("1d", "row"))]
    [('node', 'linear', 'changed', ['weight slice'])]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Change", "diff", "counts", "node_fields", "param_fields", "plan_fields", "table"]


@dataclass(frozen=True, kw_only=True)
class Change:
    """One difference between plan A and plan B.

    ``what`` is ``plan``, ``node`` or ``param``; ``status`` is ``changed``,
    ``added`` (only in B) or ``removed`` (only in A); ``fields`` lists
    ``(field, value in A, value in B)`` for every field that differs (for an added
    or removed entry, every field, with ``None`` on the missing side)."""

    what: str
    name: str
    status: str
    fields: tuple[tuple[str, Any, Any], ...]


def _comms_text(comms) -> str:
    return " ".join(f"{c.phase}:{c.kind}({','.join(c.axes)})" for c in comms) or "-"


def node_fields(n) -> dict[str, Any]:
    """The values of one node that :func:`diff` compares, as printable values."""
    return {
        "kind": n.kind, "op": n.op, "kernel": str(n.kernel) if n.kernel else "-",
        "out spec": "-" if n.out_spec is None else str(n.out_spec),
        "per-rank shape": tuple(n.local_shape), "weight slice": n.weight or "-",
        "collectives": _comms_text(n.comms), "param B/rank": n.param_bytes,
        "comm B/rank": round(n.comm_bytes), "fallback": n.fallback,
    }


def param_fields(p, mesh) -> dict[str, Any]:
    """The values of one parameter that :func:`diff` compares (spec, block shape, bytes, grad sync)."""
    return {"spec": str(p.spec), "per-rank shape": tuple(p.local_shape(mesh)),
            "param B/rank": p.local_bytes(mesh), "grad sync": ",".join(p.grad_sync) or "-"}


def plan_fields(plan) -> dict[str, Any]:
    """The plan-level values :func:`diff` compares."""
    s = plan.summary()
    return {"model": plan.model, "mode": plan.mode, "mesh": str(plan.mesh),
            "tp axes": ",".join(plan.tp_axes) or "-", "batch axes": ",".join(plan.batch_axes) or "-",
            "dp": plan.dp, "param B/rank": s["param_bytes_per_rank"],
            "comm B/rank fwd": round(s["comm_bytes_per_rank_fwd"]),
            "comm B/rank bwd": round(s["comm_bytes_per_rank_bwd"]),
            "collective calls/step": s["collective_calls_per_step"], "fallbacks": len(s["fallbacks"])}


def _compare(what: str, name: str, a: dict | None, b: dict | None) -> Change | None:
    if a is None or b is None:
        keys = a or b
        return Change(what=what, name=name, status="added" if a is None else "removed",
                      fields=tuple((k, None if a is None else a[k], None if b is None else b[k]) for k in keys))
    fields = tuple((k, a[k], b[k]) for k in a if a[k] != b[k])
    return Change(what=what, name=name, status="changed", fields=fields) if fields else None


def _by_name(items, fields) -> dict[str, dict]:
    return {x.name: fields(x) for x in items}


def diff(plan_a, plan_b) -> list[Change]:
    """Every difference between ``plan_a`` and ``plan_b``: the plan-level entry first (if
    anything there differs), then nodes in graph order (A's order, then nodes only B
    has), then parameters the same way. Equal plans give ``[]``."""
    out: list[Change] = []
    top = _compare("plan", "plan", plan_fields(plan_a), plan_fields(plan_b))
    if top:
        out.append(top)
    for what, fa, fb in (("node", _by_name(plan_a.nodes, node_fields), _by_name(plan_b.nodes, node_fields)),
                         ("param", _by_name(plan_a.params, lambda p: param_fields(p, plan_a.mesh)),
                          _by_name(plan_b.params, lambda p: param_fields(p, plan_b.mesh)))):
        for name in [*fa, *(n for n in fb if n not in fa)]:
            c = _compare(what, name, fa.get(name), fb.get(name))
            if c:
                out.append(c)
    return out


def _label(plan) -> str:
    return f"{plan.mode} · {plan.mesh}"


def table(plan_a, plan_b, changes: list[Change] | None = None, *, all_layers: bool = False):
    """A ``rich.table.Table`` of :func:`diff`: one row per changed field. A run of layers whose
    changes are those of a layer above, up to the layer index and node numbering, is one
    "same as" row, as in the plan table (:mod:`autoshard.ir.plan_table`); ``all_layers=True``
    lists every change."""
    from rich.markup import escape
    from rich.table import Table

    from ..ir.plan_table import Folded

    changes = diff(plan_a, plan_b) if changes is None else changes
    t = Table(title=f"plan diff · {plan_a.model} · A: {_label(plan_a)} → B: {_label(plan_b)}", header_style="bold")
    for col in ("what", "name", "change", "field", "A", "B"):
        t.add_column(col, overflow="fold")
    style = {"added": "green", "removed": "red", "changed": None}
    items = range(len(changes)) if all_layers else _folded(plan_a, plan_b, changes)
    for it in items:
        if isinstance(it, Folded):
            t.add_row("…", escape(it.span), "", escape(it.same), "", "", style="italic", end_section=True)
            continue
        c = changes[it]
        for i, (field, a, b) in enumerate(c.fields):
            first = i == 0
            t.add_row(c.what if first else "", escape(c.name) if first else "", c.status if first else "",
                      escape(field), escape(_value_text(a)), escape(_value_text(b)), style=style[c.status],
                      end_section=i == len(c.fields) - 1)
    return t


def _folded(plan_a, plan_b, changes: list[Change]) -> list:
    """:func:`~autoshard.ir.plan_table.fold` over the node changes, then over the parameter
    changes: a node's layer is its module's, a parameter's its own name's."""
    from ..ir.plan_table import Folded, fold

    nodes = {n.name: n.module for p in (plan_b, plan_a) for n in p.nodes}
    out: list = []
    for what in ("plan", "node", "param"):
        idx = [i for i, c in enumerate(changes) if c.what == what]
        where = [changes[i].name if what == "param" else nodes.get(changes[i].name, "") for i in idx]
        rows = [(changes[i].status, changes[i].name,
                 *(f"{f}: {_value_text(a)} → {_value_text(b)}" for f, a, b in changes[i].fields)) for i in idx]
        out += [x if isinstance(x, Folded) else idx[x] for x in fold(where, rows, set(nodes))]
    return out


def _value_text(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def counts(changes: list[Change]) -> dict[str, int]:
    """How many nodes and parameters changed, were added (only in B) or removed (only in A)."""
    out = {f"{w} {s}": 0 for w in ("nodes", "parameters") for s in ("changed", "added", "removed")}
    for c in changes:
        if c.what != "plan":
            out[f"{'nodes' if c.what == 'node' else 'parameters'} {c.status}"] += 1
    return out
