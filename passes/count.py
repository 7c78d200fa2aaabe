"""The counts of the plan: collectives with their bytes, parameter bytes and FLOPs,
and the rows they go in (passes over the walk's result, docs/design.md, "The
propagation passes").

:func:`count_comms` requires the steps of :func:`~autoshard.passes.layouts.relayouts`
and :func:`~autoshard.passes.grad_needs.grad_syncs`; it ensures each visit's
``comms``: its re-layouts' collectives (an identical re-layout of one value is made
once and shared: one backward all-reduce for q, k and v reading the same normed
hidden state), its kernel's (less the backward ones whose gradient nothing needs),
its output cut's backward gather and its in-graph gradient sums. :func:`plan_rows`
then builds the plan's :class:`~autoshard.ir.plan.NodePlan` rows.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import fx

from autoshard.ir.argpath import get_arg
from autoshard.ir.kernels import KernelIO
from autoshard.ir.plan import Comm, NodePlan
from autoshard.ir.spec import ShardSpec, replicated
from autoshard.policies.linear_ops import linear_operands

from .layouts import before_cuts
from .row_order import LOCAL_ROWS_NOTE, RowFact
from .rule_context import aten_name, is_tensor_val
from .walked import Visit, Walked, evolve

__all__ = ["count_comms", "plan_rows", "state_rows", "step_comms"]


def count_comms(walked: Walked) -> Walked:
    """``walked`` with every visit's ``comms`` and the outputs' (``output_comms``)."""
    made: set = set()       # (value name, steps): re-layouts already made (the rewrite shares them)
    walked = walked.with_visits(lambda v: evolve(v, comms=tuple(_visit_comms(walked, v, made))))
    comms: list[Comm] = []
    items = _output_items(walked.output)
    for (_, i), steps in walked.output_steps:
        a = items[i]
        comms += step_comms(walked, a, walked.specs[a.name], steps, False)
    return dataclasses.replace(walked, output_comms=tuple(comms))


def _output_items(node) -> list:
    if node is None:
        return []
    flat = node.args[0]
    return list(flat) if isinstance(flat, (list, tuple)) else [flat]


def _visit_comms(walked: Walked, v: Visit, made: set) -> list[Comm]:
    node, choice = v.node, v.choice
    grad = node.name in walked.needs_grad
    comms: list[Comm] = []
    for path, steps in v.arg_steps:
        a = get_arg(node, path)
        key = (a.name, steps)
        if key in made:
            continue
        made.add(key)
        comms += step_comms(walked, a, walked.spec(a), steps, a.name in walked.needs_grad)
    comms += _kernel_comm_rows(walked, v)
    cuts = tuple(st for st in choice.post if st.op == "scatter")
    if cuts and isinstance(choice.out, ShardSpec):      # a cut output (context parallelism): its backward gather
        comms += step_comms(walked, node, before_cuts(choice), cuts, grad)
    for path, step, _, target in v.grad_sums:
        comms += step_comms(walked, get_arg(node, path), walked.param_spec[target], (step,), True)
    return comms


def step_comms(walked: Walked, a: fx.Node, cur: ShardSpec, steps, needs_grad: bool) -> list[Comm]:
    """The collectives of ``steps`` applied to value ``a`` laid out as ``cur``."""
    shape = walked.shapes.concrete_val(a.meta["val"])
    eb = a.meta["val"].element_size()
    out: list[Comm] = []
    s = cur
    for st in steps:
        comms, s = st.effect(s, shape, walked.mesh, eb, needs_grad)
        out += comms
    return out


def _kernel_comm_rows(walked: Walked, v: Visit) -> list[Comm]:
    """The kernel's collectives as plan rows, less the backward ones whose gradient
    nothing needs."""
    node, mesh = v.node, walked.mesh
    comms: list[Comm] = []
    for kc in _kernel_comms(walked, v):
        if kc.phase == "bwd" and node.name not in walked.needs_grad:    # backward never reaches it
            continue
        if kc.phase == "bwd" and kc.needs_grad_of:
            if not any(isinstance(get_arg(node, p), fx.Node) and get_arg(node, p).name in walked.needs_grad
                       for p in kc.needs_grad_of):
                continue
        comms.append(Comm(phase=kc.phase, kind=kc.kind, axes=kc.axes, group_size=mesh.size(kc.axes),
                          buffer_bytes=kc.numel * _elem_bytes(node)))
    return comms


def _kernel_comms(walked: Walked, v: Visit):
    """The kernel's collectives for the local shapes of this plan (none without a kernel)."""
    node, choice, mesh = v.node, v.choice, walked.mesh
    if choice.kernel is None:
        return ()
    shapes = {}
    for path, req in v.in_specs.items():
        a = get_arg(node, path)
        if isinstance(a, fx.Node) and is_tensor_val(a.meta.get("val")):
            shapes[path] = req.local_shape(walked.shapes.concrete_val(a.meta["val"]), mesh)
    val = node.meta.get("val")
    out = before_cuts(choice)       # the kernel's own output, before a cut after it
    oshape = out.local_shape(walked.shapes.concrete_val(val), mesh) \
        if isinstance(out, ShardSpec) and is_tensor_val(val) else ()
    return choice.kernel.comms(KernelIO(in_shapes=shapes, out_shape=oshape, mesh=mesh))


def plan_rows(walked: Walked) -> list[NodePlan]:
    """The plan's rows in graph order: the walk's own rows, one per visit that splits
    or runs a kernel, and the outputs' gathers (when there are any)."""
    rows = []
    for e in walked.entries:
        if not isinstance(e, Visit):
            rows.append(e)
        elif e.row:
            rows.append(_node_plan(walked, e))
    if walked.output_steps:
        rows.append(NodePlan(name="output", op="output", kind="other", module="", out_spec=None,
                             arg_steps=walked.output_steps, comms=walked.output_comms,
                             notes=("outputs gathered to full",)))
    return rows


def _node_plan(walked: Walked, v: Visit) -> NodePlan:
    """``v``'s row of the plan."""
    node, ann, choice = v.node, v.ann, v.choice
    out = choice.out
    val = node.meta.get("val")
    gshape = walked.shapes.concrete_val(val) if is_tensor_val(val) else ()
    lshape = out.local_shape(gshape, walked.mesh) if isinstance(out, ShardSpec) and gshape else ()
    notes = tuple(n for n in choice.notes if n) + _whole_note(walked, v) + _row_order_note(walked, node)
    return NodePlan(name=node.name, op=_op_name(node), flops=_linear_flops(walked, node, ann, gshape),
                    kind=ann.kind if ann.kind in ("linear", "norm", "attention", "embedding", "loss") else "other",
                    module=ann.module, out_spec=out, kernel=choice.kernel,
                    arg_steps=v.arg_steps + tuple((path, (step,)) for path, step, _, _ in v.grad_sums),
                    post=tuple(choice.post), patches=tuple(choice.patches.items()), comms=v.comms,
                    global_shape=gshape, local_shape=lshape, weight=choice.weight,
                    param_bytes=_param_bytes(walked, v), notes=notes + tuple(n for _, _, n, _ in v.grad_sums),
                    fallback=choice.fallback)


def state_rows(walked: Walked) -> list[NodePlan]:
    """A row per state input (:func:`~autoshard.passes.propagate.state_inputs`): the
    layout its first write gave it, which is the block each rank allocates and passes."""
    out = []
    for n in walked.gm.graph.nodes:
        if n.name not in walked.state:
            continue
        spec = walked.specs.setdefault(n.name, replicated(n.meta["val"].dim()))
        g = walked.shapes.concrete_val(n.meta["val"])
        local = spec.local_shape(g, walked.mesh)
        out.append(NodePlan(name=n.name, op="placeholder", kind="state", module="", out_spec=spec,
                            global_shape=g, local_shape=local,
                            param_bytes=math.prod(local) * n.meta["val"].element_size(),
                            notes=("state written in place (KV cache): each rank passes its block",)))
    return out


def _param_bytes(walked: Walked, v: Visit) -> int:
    """Bytes of the parameters a Linear / embedding / norm holds on one rank."""
    pbytes = 0
    if v.ann.kind not in ("linear", "embedding", "norm"):
        return pbytes
    for path, req in v.in_specs.items():
        a = get_arg(v.node, path)
        if a.op == "get_attr" and a.target in walked.params:
            pbytes += math.prod(req.local_shape(walked.shapes.concrete_val(a.meta["val"]), walked.mesh)) * \
                a.meta["val"].element_size()
    return pbytes


def _linear_flops(walked: Walked, node, ann, gshape) -> int:
    """Dense forward FLOPs of a Linear (``2·N·k·n``); 0 for any other node."""
    if ann.kind != "linear" or not gshape:
        return 0
    _, wp, _, nd, kd = linear_operands(node)
    w = get_arg(node, wp)
    if isinstance(w, fx.Node) and is_tensor_val(w.meta.get("val")):
        ws = walked.shapes.concrete_val(w.meta["val"])
        if len(ws) > max(nd, kd):
            return 2 * math.prod(gshape[:-1]) * ws[nd] * ws[kd]
    return 0


def _row_order_note(walked: Walked, node) -> tuple[str, ...]:
    """A note where the batch split leaves this value's rows in a rank-local order (rows
    sorted by expert on each rank's own tokens, :mod:`.row_order`), or makes its values
    positions among the rank's rows: exact, but its local block is not a block of the
    dense value (``autoshard verify`` compares it where the order is undone)."""
    f = walked.rows.get(node.name)
    facts = f if isinstance(f, tuple) else (f,)
    if not walked.batch_axes or not any(isinstance(x, RowFact) and (x.order is not None or x.index_into is not None)
                                        for x in facts):
        return ()
    return (LOCAL_ROWS_NOTE,)


def _whole_note(walked: Walked, v: Visit) -> tuple[str, ...]:
    """A note for a Linear or lookup whose weight the rule held whole over every
    tensor-parallel axis without saying why (every held-whole weight must say why:
    the plan reads as split otherwise); empty where it is split or already explained."""
    node, ann, policy = v.node, v.ann, walked.policy
    tp = tuple(a for a in policy.tp_axes if a not in ("dp", "dep"))
    if ann.kind not in ("linear", "embedding") or walked.mesh.size(tp) <= 1 \
            or any(n.startswith("whole:") for n in v.choice.notes):
        return ()
    wp = linear_operands(node)[1] if ann.kind == "linear" else (0,)
    w, req = get_arg(node, wp), v.in_specs.get(wp)
    if not (isinstance(w, fx.Node) and w.op == "get_attr" and w.target in walked.params and req is not None):
        return ()
    if set(req.axes) & set(tp):
        return ()
    return (f"whole: the {policy.name} rule found no split of `{w.target}` over "
            f"{','.join(tp)} for `{aten_name(node)}`",)


def _elem_bytes(node) -> int:
    v = node.meta.get("val")
    if isinstance(v, (list, tuple)):
        v = v[0]
    return v.element_size() if is_tensor_val(v) else 4


def _op_name(node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.replace("aten::", "") + ("" if t._overloadname == "default" else "." + t._overloadname)
    return getattr(t, "__name__", str(t))
