"""The plan table (:meth:`autoshard.ir.plan.ShardingPlan.table`): one row per annotated
node, each run of repeated layers shown once.

A deep model's plan is mostly one layer repeated: Llama-7B's 32 decoder layers give
~300 rows, ~1,600 terminal lines, of which nobody reads 31 copies (and rich spends most
of ``autoshard plan``'s printing time laying them out). By default a run of consecutive
layers whose rows equal those of a layer shown above, once the layer index in module
paths and the numbering of node names are abstracted, is folded into one row saying
which layers are the same as which. A layer is a module-path prefix ending in an integer
(``<prefix>.<i>``, the repeated stacks :mod:`autoshard.passes.stamp` grows): the
structure of the path, never a model's names. A layer that differs in any column (the
first layer that gathers the mask once, a layer with another kernel, collective or
note) is shown in full, and the layers after it that repeat it fold into it.
``all_layers=True`` lists every row.

    >>> rows = [("linear", "model.layers.0.q"), ("linear_1", "model.layers.1.q"),
    ...         ("linear_2", "model.layers.2.q"), ("lm", "lm_head")]
    >>> names = {"linear", "linear_1", "linear_2", "lm"}
    >>> [r if isinstance(r, int) else r.text for r in fold([m for _, m in rows], rows, names)]
    [0, 'model.layers.1 … model.layers.2: same as model.layers.0 (2 layers)', 3]
    >>> rows[1] = ("linear_1", "model.layers.1.k")                      # layer 1 differs
    >>> [r if isinstance(r, int) else r.text for r in fold([m for _, m in rows], rows, names)]
    [0, 1, 'model.layers.2: same as model.layers.0 (1 layer)', 3]
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = ["table", "fold", "Folded", "layer_of", "COLUMNS"]

COLUMNS = ("node", "op", "module", "kernel", "global shape", "per-rank shape", "weight slice",
           "collectives (fwd / bwd)", "comm B/rank", "param B/rank", "notes")

_LAYER = re.compile(r"^(.*?)\.(\d+)(?=\.|$)")      # the outermost integer segment of a module path
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBERED = re.compile(r"_\d+$")                     # export numbers a name's repeats: linear, linear_1, ...


def layer_of(module: str) -> tuple[str, int] | None:
    """``(stack prefix, layer index)`` of a module path, from its outermost integer segment
    (an expert's or a sub-layer's index inside a layer stays part of the layer).

    >>> layer_of("model.layers.12.mlp.experts.3.w1"), layer_of("lm_head")
    (('model.layers', 12), None)
    """
    m = _LAYER.match(module or "")
    return (m.group(1), int(m.group(2))) if m else None


@dataclass(frozen=True)
class Folded:
    """The row standing for layers ``first`` … ``last`` of ``prefix``, each the same as layer ``ref``."""

    prefix: str
    ref: int
    first: int
    last: int

    @property
    def count(self) -> int:
        return self.last - self.first + 1

    @property
    def span(self) -> str:
        a, b = f"{self.prefix}.{self.first}", f"{self.prefix}.{self.last}"
        return a if self.first == self.last else f"{a} … {b}"

    @property
    def same(self) -> str:
        return f"same as {self.prefix}.{self.ref} ({self.count} layer{'s' * (self.count > 1)})"

    @property
    def text(self) -> str:
        return f"{self.span}: {self.same}"


def _blocks(tags: list) -> list[tuple[int, int, tuple[str, int]]]:
    """``(start, end, tag)`` of each layer's rows, in order: from its first row to its last,
    with the rows in between that belong to no layer (a node a pass added without a module
    path); a layer with another layer's row in between is in none of them: it is shown in full."""
    span: dict = {}
    for i, t in enumerate(tags):
        if t is not None:
            span[t] = (span[t][0] if t in span else i, i + 1)
    return sorted((s, e, t) for t, (s, e) in span.items() if all(x is None or x == t for x in tags[s:e]))


def _normal(cells: tuple, tag: tuple[str, int], names: set) -> tuple:
    """``cells`` with the layer index made relative (``model.layers.7`` in layer 7 reads
    ``model.layers.@0``, layer 6 ``@-1``) and node names stripped of their numbering."""
    prefix, i = tag
    pat = _index_in(prefix)

    def one(c: str) -> str:
        c = pat.sub(lambda m: f"{prefix}.@{int(m.group(1)) - i}", c)
        return _WORD.sub(lambda m: _NUMBERED.sub("", m.group(0)) if m.group(0) in names else m.group(0), c)

    return tuple(one(str(c)) for c in cells)


@functools.lru_cache(maxsize=64)
def _index_in(prefix: str) -> re.Pattern:
    return re.compile(re.escape(prefix) + r"\.(\d+)(?=\.|\b|$)")


def fold(modules: list[str], rows: list[tuple], names: set) -> list:
    """The rows to show, in order: a row's index, or a :class:`Folded` standing for a run
    of consecutive layers whose ``rows`` equal those of a layer shown above (``modules``:
    each row's module path; ``names``: the plan's node names, whose numbering is
    abstracted). A layer that matches none is shown and may be the reference of later
    ones, so one odd layer amid a stack costs only its own rows."""
    blocks = _blocks([layer_of(m) for m in modules])
    keys = [(p, tuple(_normal(r, (p, i), names) for r in rows[s:e])) for s, e, (p, i) in blocks]
    shown: dict = {}                # a shown layer's key -> its index
    out: list = []
    done = 0                        # the rows before this one are placed
    k = 0
    while k < len(blocks):
        s, _, (prefix, i) = blocks[k]
        ref = shown.get(keys[k])
        if ref is None:
            shown[keys[k]] = i
            k += 1
            continue
        m = k + 1                   # the run: the next layers of the stack, adjacent rows, the same key
        while (m < len(blocks) and blocks[m][2] == (prefix, i + m - k) and blocks[m][0] == blocks[m - 1][1]
               and keys[m] == keys[k]):
            m += 1
        out.extend(range(done, s))
        out.append(Folded(prefix, ref, i, i + m - k - 1))
        done, k = blocks[m - 1][1], m
    out.extend(range(done, len(rows)))
    return out


def _cells(n) -> tuple:
    fwd = ", ".join(f"{c.kind}({','.join(c.axes)})" for c in n.comms if c.phase == "fwd") or "-"
    bwd = ", ".join(f"{c.kind}({','.join(c.axes)})" for c in n.comms if c.phase == "bwd") or "-"
    return (n.name, n.op, n.module, n.kernel.name if n.kernel else "-", _shape(n.global_shape), _shape(n.local_shape),
            n.weight or "-", f"{fwd} / {bwd}", f"{n.comm_bytes:,.0f}", f"{n.param_bytes:,}", "; ".join(n.notes))


def table(plan, *, all_nodes: bool = False, all_layers: bool = False):
    """The ``rich.table.Table`` of :meth:`autoshard.ir.plan.ShardingPlan.table`."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"autoshard plan · {plan.model} · {plan.mode} · mesh {plan.mesh}",
              show_lines=False, header_style="bold")
    for col in COLUMNS:
        t.add_column(col, overflow="fold")
    # an op kept for its kernel (a synced BatchNorm: samples meet there) has its row
    shown = [n for n in plan.nodes if all_nodes or n.kind != "other" or n.fallback or n.kernel is not None]
    rows = [_cells(n) for n in shown]
    items = range(len(rows)) if all_layers else fold([n.module for n in shown], rows,
                                                     {n.name for n in plan.nodes})
    for it in items:
        if isinstance(it, Folded):
            t.add_row("…", "", escape(it.span), *[""] * 7, escape(it.same), style="italic")
        else:
            t.add_row(*(escape(str(c)) for c in rows[it]), style="yellow" if shown[it].fallback else None)
    return t


def _shape(s) -> str:
    if not s:
        return "-"
    if isinstance(s[0], (tuple, list)):
        return " ".join(_shape(x) for x in s)
    return "[" + ", ".join(str(x) for x in s) + "]"
