"""Node-by-node comparison of a rewritten graph with the dense graph it came from.

The rewrite tags every planned node's final value with its plan name, its spec and
its capture-time value (:data:`autoshard.runtime.selfcheck.META`). Running the
dense (prepared, unsplit) graph records each node's global value by name; running
this rank's graph then compares each tagged local value with the block of the
dense value that the spec says this rank holds (:meth:`ShardSpec.local`). A wrong
rule shows at the first node whose block differs, with its op and both figures,
instead of as a loss that is off three layers later.

Values the plan leaves as partial sums (a row-parallel product before its
reduction) are summed over their axes first where the caller gives a ``reduce``
(:meth:`ShardedModule.compare` does: a collective of its own), else marked
``partial`` and compared where the graph reduces them. With data-parallel replicas each rank compares
against the dense graph run on the global batch (every replica's rows; the spec's
``dp`` axis picks the replica's block), as the plan's global shapes are.

    >>> import torch
    >>> from torch import fx
    >>> from autoshard.ir.mesh import Mesh
    >>> from autoshard.ir.spec import ShardSpec
    >>> from autoshard.runtime.selfcheck import META
    >>> dense = fx.symbolic_trace(lambda x: x * 2)
    >>> ref = record(dense, {"x": torch.arange(8.0).view(2, 4)})
    >>> local = fx.symbolic_trace(lambda x: x * 2 + (x > 2))      # a wrong rank-local graph
    >>> n = next(n for n in local.graph.nodes if n.name == "add")
    >>> n.meta[META] = ("mul", ShardSpec(dims=((), ("tp",))), None)
    >>> mesh = Mesh(axes=("tp",), sizes=(2,))
    >>> _, rows = compare(local, mesh, {"x": torch.tensor([[2.0, 3.0], [6.0, 7.0]])}, ref, rank=1)
    >>> rows[0].name, rows[0].max_abs, rows[0].ok
    ('mul', 1.0, False)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ..ir.spec import ShardSpec
from .selfcheck import META, op_name

__all__ = ["NodeDiff", "Comparison", "record", "compare", "abs_diff", "merge"]


@dataclass(frozen=True)
class NodeDiff:
    """One planned node's comparison on one rank (or merged over ranks, :func:`merge`).

    ``max_abs``: the largest ``|local − dense block|``; ``excess``: the largest
    ``|local − dense| − (atol + rtol·|dense|)`` (≤ 0 when within tolerance);
    ``status``: ``"ok"``, ``"mismatch"``, ``"partial"`` (a pending sum, compared where it is
    reduced), ``"index"`` (split integers: indices local to the rank's block, e.g. an
    ``arange`` over the batch block, not comparable with the dense values), ``"uninitialised"``
    (an ``empty_like``: memory not yet written), ``"local rows"`` (rows in a rank-local order,
    e.g. sorted by expert), ``"shape"`` (the local shape is not the spec's block) or ``"missing"``
    (no dense value of that name)."""

    name: str
    op: str
    spec: str
    order: int
    status: str
    max_abs: float = 0.0
    excess: float = float("-inf")

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "partial", "index", "local rows", "uninitialised", "missing")


def abs_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a − b|`` in float64, where equal values (equal infinities: log(0) of a relative
    position, a -inf mask) and NaN on both sides differ by nothing; NaN where only one side is."""
    a, b = a.detach().double(), b.detach().double()
    same = (a == b) | (a.isnan() & b.isnan())
    return torch.where(same, torch.zeros_like(a), (a - b).abs())


class _Recorder(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict = {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.op == "call_function":
            # a copy: a later in-place op (copy_ into a slice of new_zeros) would change a view
            self.values[n.name] = out.detach().clone() if isinstance(out, torch.Tensor) else \
                type(out)(x.detach().clone() if isinstance(x, torch.Tensor) else x for x in out) \
                if isinstance(out, (tuple, list)) else out
        return out


def record(gm: fx.GraphModule, inputs: dict) -> dict:
    """Run the dense graph ``gm`` on ``inputs`` (its keyword arguments, by placeholder
    name) and return every ``call_function`` node's output by node name."""
    rec = _Recorder(gm)
    rec.run(*[inputs[n.target] for n in gm.graph.nodes if n.op == "placeholder"])
    return rec.values


class _Comparer(fx.Interpreter):
    def __init__(self, gm, mesh, dense: dict, rank: int, atol: float, rtol: float, reduce, local_rows=frozenset()):
        super().__init__(gm)
        self.mesh, self.dense, self.rank, self.atol, self.rtol = mesh, dense, rank, atol, rtol
        self.reduce, self.local_rows = reduce, local_rows
        self.rows: list[NodeDiff] = []

    def run_node(self, n):
        out = super().run_node(n)
        tag = n.meta.get(META)
        if tag is not None:
            if _uninitialised(n):               # memory not yet written: nothing to compare
                self.rows.append(NodeDiff(tag[0], op_name(n), str(tag[1]), len(self.rows), "uninitialised"))
            elif tag[0] in self.local_rows:     # a rank-local row order: compared where it is undone
                self.rows.append(NodeDiff(tag[0], op_name(n), str(tag[1]), len(self.rows), "local rows"))
            else:
                self._compare(n, out, tag)
        return out

    def _compare(self, n, out, tag) -> None:
        name, specs, _ = tag
        ref = self.dense.get(name)
        pairs = list(zip(out, ref if isinstance(ref, (tuple, list)) else [None] * len(out), specs)) \
            if isinstance(specs, tuple) and isinstance(out, (tuple, list)) else [(out, ref, specs)]
        worst, excess, status = 0.0, float("-inf"), "ok" if ref is not None else "missing"
        for got, want, spec in pairs:
            if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) or not isinstance(spec, ShardSpec):
                continue
            if spec.partial:
                summed = self.reduce(got, spec.partial) if self.reduce is not None else None
                if summed is None:
                    status = "partial" if status == "ok" else status
                    continue
                got, spec = summed, spec.with_partial(())
            try:
                block = spec.local(want, self.mesh, self.rank)
            except Exception:  # noqa: BLE001 - a block that cannot be cut is a shape finding
                block = None
            if block is None or block.shape != got.shape:
                status = "shape"
                continue
            if not (got.dtype.is_floating_point or got.dtype.is_complex):
                if spec.axes:           # split integers are rank-local indices (arange over a batch block)
                    status = "index" if status == "ok" else status
                    continue
                bad = (got != block)
                err = float(bad.any())
                worst, excess = max(worst, err), max(excess, err - 0.5)
            else:
                g, w = got.detach().double(), block.double()
                atol = self.atol.get(name, 1e-5) if isinstance(self.atol, dict) else self.atol
                diff = abs_diff(g, w)
                nan = g.isnan() != w.isnan()
                if diff.numel():
                    worst = max(worst, float(diff.nan_to_num(float("inf")).max()))
                    ex = diff - (atol + self.rtol * w.abs())
                    ex = torch.where(nan, torch.full_like(ex, float("inf")), ex.nan_to_num(float("inf")))
                    excess = max(excess, float(ex.max()))
            if status == "ok" and excess > 0:
                status = "mismatch"
        self.rows.append(NodeDiff(name, op_name(n), str(specs if not isinstance(specs, tuple) else
                                                       ", ".join(map(str, specs))),
                                  len(self.rows), status, worst, excess))


def compare(gm: fx.GraphModule, mesh, inputs: dict, dense: dict, *, rank: int, atol: "float | dict" = 1e-5,
            rtol: float = 1e-5, reduce=None, local_rows=frozenset()):
    """Run this rank's rewritten graph ``gm`` on ``inputs`` and compare each planned
    node with its block of ``dense`` (from :func:`record`, on the global batch).
    ``atol`` may map node names to their own absolute tolerance (1e-5 for the others).
    ``reduce(local, axes)``: the sum of a partial value over the ranks of ``axes`` (a
    collective every rank reaches at the same node), or None to leave it ``partial``.
    ``local_rows``: nodes whose rows the plan keeps in a rank-local order (rows sorted by
    expert on each rank's tokens): not compared, status ``"local rows"``.

    Returns ``(what gm returns, [NodeDiff] in graph order)``."""
    cmp = _Comparer(gm, mesh, dense, rank, atol, rtol, reduce, frozenset(local_rows))
    out = cmp.run(*[inputs[n.target] for n in gm.graph.nodes if n.op == "placeholder"])
    return out, cmp.rows


_RANK = {"shape": 7, "mismatch": 6, "ok": 5, "partial": 4, "index": 3, "local rows": 2, "uninitialised": 1,
         "missing": 0}
_UNINITIALISED = {"empty", "empty_like", "new_empty", "empty_strided"}
# a view made before its base is written holds the same unwritten memory (DeepSeek-V2 fills
# the slices of a new_empty key with copy_ after slicing it)
_VIEWS = {"slice", "select", "narrow", "view", "_unsafe_view", "reshape", "as_strided", "alias", "unsqueeze",
          "squeeze", "transpose", "t", "permute", "expand", "unflatten", "split", "split_with_sizes", "chunk",
          "unbind", "getitem"}


def _uninitialised(n: fx.Node) -> bool:
    """An ``empty``-like node, or a view of one (through views only; one taken after the
    writes is skipped too: never compared, never a false mismatch)."""
    while True:
        op = op_name(n)
        if op in _UNINITIALISED:
            return True
        if op not in _VIEWS or not n.args or not isinstance(n.args[0], fx.Node):
            return False
        n = n.args[0]


def merge(per_rank: list[list[NodeDiff]]) -> list[NodeDiff]:
    """One row per node over every rank's rows: the worst status and figures, in graph order."""
    out: dict[str, NodeDiff] = {}
    for rows in per_rank:
        for r in rows:
            cur = out.get(r.name)
            if cur is None:
                out[r.name] = r
                continue
            status = max(cur.status, r.status, key=_RANK.__getitem__)
            out[r.name] = NodeDiff(r.name, r.op, r.spec, min(cur.order, r.order), status,
                                   max(cur.max_abs, r.max_abs), max(cur.excess, r.excess))
    return sorted(out.values(), key=lambda r: r.order)


@dataclass(frozen=True)
class Comparison:
    """Every planned node compared over every rank (:meth:`ShardedModule.compare`)."""

    rows: list
    kinds: dict         # node -> (kind, module)

    @property
    def first_mismatch(self) -> "NodeDiff | None":
        """The first node in graph order whose block differs (or has the wrong shape)."""
        return next((r for r in self.rows if not r.ok), None)

    def worst(self, top: int | None = 25) -> list:
        """The rows worst first: past the tolerance first, then by ``max_abs``."""
        rows = sorted(self.rows, key=lambda r: (r.ok, -r.excess, -r.max_abs))
        return rows[:top] if top else rows

    def table(self, top: int | None = 25):
        """A rich table of :meth:`worst`: node, op, kind, module, spec, max |diff|, status."""
        from rich.table import Table

        t = Table(title=f"planned nodes, worst first ({min(top or len(self.rows), len(self.rows))} of "
                        f"{len(self.rows)})", title_justify="left")
        for c in ("node", "op", "kind", "module", "spec", "max |sharded − dense|", "status"):
            t.add_column(c, justify="right" if c.startswith("max") else "left")
        for r in self.worst(top):
            kind, module = self.kinds.get(r.name, ("", ""))
            t.add_row(r.name, r.op, kind, module, r.spec,
                      f"{r.max_abs:.3g}" if r.status in ("ok", "mismatch") else "—", r.status,
                      style="red" if not r.ok else None)
        return t
