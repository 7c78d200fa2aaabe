"""Runtime self-check: every node's local output shape against its plan spec.

A plan is a promise about every value of the rewritten graph: its global shape
(from the capture) and how it is split (its :class:`~autoshard.ir.spec.ShardSpec`),
hence the shape each rank holds. A rule that is wrong about a layout usually
shows first as a local tensor of another shape, often far from the node that
caused it (an ``expand`` that mis-reads a batch dim surfaces as a size mismatch
three ops later), or not at all (a matmul that broadcasts). This module runs a
rewritten graph node by node once and compares each planned node's local shape
with the plan's, so a planner bug stops at the node that broke the promise,
with its op, spec and both shapes, instead of becoming a wrong number.

:class:`~autoshard.module.ShardedModule` runs it on the first call of every
captured graph (one eager forward through :class:`torch.fx.Interpreter`, then
the plain graph), and on every call under ``shard(..., debug=True)``. The check
itself is local: no collective beyond the graph's own.

    >>> import torch
    >>> from torch import fx
    >>> from autoshard.ir.mesh import Mesh
    >>> from autoshard.ir.spec import ShardSpec
    >>> gm = fx.symbolic_trace(lambda x: x * 2)
    >>> node = next(n for n in gm.graph.nodes if n.op == "call_function")
    >>> node.meta[META] = (node.name, ShardSpec(dims=((), ("tp",))), torch.empty(4, 6))
    >>> mesh = Mesh(axes=("tp",), sizes=(2,))
    >>> try:
    ...     run_checked(gm, mesh, {"x": torch.ones(4, 6)})
    ... except PlanCheckError as e:
    ...     print(str(e).split(" where")[0])
    planner bug: node mul (mul) gives a local tensor of shape (4, 6)
"""

from __future__ import annotations

import torch
from torch import fx

from ..ir.errors import ShardingError
from ..ir.spec import ShardSpec

__all__ = ["META", "PlanCheckError", "expected_local_shape", "op_name", "run_checked", "shape_of"]

META = "autoshard_check"        # node.meta key the rewrite sets: (plan node name, out spec, capture value)


class PlanCheckError(ShardingError):
    """A node's local output does not have the shape its plan spec says: a bug of the
    planner (a rule that mis-read a layout), caught before it becomes a wrong result."""


def _bind(gm: fx.GraphModule, inputs: dict, dp: int = 1) -> dict:
    """Free symbols of the capture's shapes, bound from the call's inputs: every TP
    rank gets its replica's batch, so each placeholder's symbolic dims read off
    directly, the leading (batch) one times the ``dp`` replicas the plan's global
    batch spans."""
    env = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        v, x = node.meta.get("val"), inputs.get(node.target)
        shape = shape_of(v)
        if shape is None or not isinstance(x, torch.Tensor) or len(shape) != x.dim():
            continue
        for d, (expr, n) in enumerate(zip(shape, x.shape)):
            if getattr(expr, "is_Symbol", False):
                env[expr] = int(n) * (dp if d == 0 else 1)
    return env


def shape_of(val) -> tuple | None:
    """A capture value's shape, symbolic sizes as sympy expressions: of a (fake) tensor,
    or of the shape-only record a relaunch keeps (:class:`autoshard.launch.launch_cache.ShapeOnly`)."""
    if isinstance(val, torch.Tensor):
        return tuple(s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in val.shape)
    shape = getattr(val, "shape", None)
    return tuple(shape) if isinstance(shape, tuple) else None


def expected_local_shape(val, spec: ShardSpec, mesh, env: dict) -> tuple[int, ...] | None:
    """The local shape the plan promises for a value whose capture-time (global,
    possibly symbolic) shape is ``val.shape``, or ``None`` where a size cannot be
    evaluated from ``env`` (a symbol the inputs do not bind)."""
    sizes = shape_of(val)
    if sizes is None or not isinstance(spec, ShardSpec) or spec.ndim != len(sizes):
        return None
    shape = []
    for s in sizes:
        if isinstance(s, int):
            shape.append(s)
        else:
            if not s.free_symbols <= set(env):
                return None
            shape.append(int(s.xreplace(env)))
    return spec.local_shape(shape, mesh)


class _Checker(fx.Interpreter):
    def __init__(self, gm, mesh, env):
        super().__init__(gm)
        self.mesh, self.sizes = mesh, env        # (Interpreter.env is its own)

    def run_node(self, n):
        out = super().run_node(n)
        tag = n.meta.get(META)
        if tag is not None:
            name, specs, vals = tag
            pairs = zip(vals, specs) if isinstance(specs, tuple) and isinstance(vals, (tuple, list)) \
                else [(vals, specs)]
            outs = out if isinstance(specs, tuple) and isinstance(out, (tuple, list)) else [out]
            for (v, s), o in zip(pairs, outs):
                want = expected_local_shape(v, s, self.mesh, self.sizes)
                if want is not None and isinstance(o, torch.Tensor) and tuple(o.shape) != want:
                    raise PlanCheckError(
                        f"planner bug: node {name} ({op_name(n)}) gives a local tensor of shape {tuple(o.shape)} "
                        f"where its plan spec {s} promises {want}; the rule that chose this layout is wrong "
                        f"(please report it with this message). The check runs on the first call of each "
                        f"graph (every call under debug=True)", node=n)
        return out


def op_name(n) -> str:
    """A node's op as plan tables name it: ``add`` for ``aten.add.Tensor``, else the target's name."""
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    return getattr(t, "__name__", str(t))


def run_checked(gm: fx.GraphModule, mesh, inputs: dict, dp: int = 1):
    """Run ``gm`` on ``inputs`` (its keyword arguments) node by node, checking each
    planned node's local output shape (see the module doc); returns what ``gm``
    returns. Raises :class:`PlanCheckError` at the first node that differs. ``dp``:
    the data-parallel replicas (each called with its own batch)."""
    env = _bind(gm, inputs, dp)
    args = [inputs[n.target] for n in gm.graph.nodes if n.op == "placeholder"]
    return _Checker(gm, mesh, env).run(*args)
