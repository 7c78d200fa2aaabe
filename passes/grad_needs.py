"""Gradient needs: which values backward reaches, and the steps that keep the
gradient invariant (a pass over the walk's result, docs/design.md, "The propagation passes").

The invariant: *a replicated value's gradient is complete and identical on every
rank*. Where an op consumes a value replicated on mesh axis ``a`` while its output is
split or partial on ``a``, the value's gradient from that op is partial on ``a``: the
edge gets ``copy_to(a)`` (identity forward, all-reduce backward), or, for a parameter
consumed directly, ``a`` joins the parameter's after-backward gradient all-reduce
(one all-reduce per parameter, however many uses).

:func:`needs_grad` runs before the walk (a fact of the graph alone);
:func:`grad_syncs` after :func:`~autoshard.passes.layouts.relayouts`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from autoshard.ir.argpath import get_arg
from autoshard.ir.plan import Step
from autoshard.ir.spec import ShardSpec

from .layouts import before_cuts
from .rule_context import is_tensor_val
from .walked import Visit, Walked, evolve

__all__ = ["grad_syncs", "needs_grad"]

aten = torch.ops.aten


# ops whose floating output is a fresh tensor of another's shape: autograd gives it no
# gradient unless an in-place op writes a value that needs one into it
# (``zeros_like(scores).scatter_(1, idx, 1.0)`` never needs one: a router's one-hot mask)
_FRESH = frozenset({aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.rand_like,
                    aten.randn_like, aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full})


def _writes_into(n: fx.Node) -> bool:
    """Whether ``n`` is an in-place ATen op (``index_add_``, ``scatter_``, ``copy_``) on a graph value."""
    name = getattr(getattr(n.target, "_overloadpacket", None), "__name__", "")
    return name.endswith("_") and not name.endswith("__") and bool(n.args) and isinstance(n.args[0], fx.Node)


_VIEWS = frozenset({aten.slice, aten.select, aten.view, aten._unsafe_view, aten.as_strided, aten.narrow,
                    aten.unsqueeze, aten.squeeze, aten.transpose, aten.permute, aten.expand, aten.alias,
                    aten.t, aten.diagonal, aten.unflatten, aten.split, aten.chunk})


def _aliased(a: fx.Node) -> list[str]:
    """``a`` and the values it is a view of, up to the base tensor (an in-place write into a
    view writes its base)."""
    names = [a.name]
    while getattr(a.target, "_overloadpacket", None) in _VIEWS and a.args and isinstance(a.args[0], fx.Node):
        a = a.args[0]
        names.append(a.name)
    return names


def _carries_grad(t) -> bool:
    """Whether autograd can give tensor value ``t`` a gradient: a floating or a complex
    dtype (a rotary embedding through ``view_as_complex``/``view_as_real``, DeepSeek-V2's,
    is complex between the two; its values need gradients as the real ones do)."""
    return is_tensor_val(t) and (t.is_floating_point() or t.is_complex())


def needs_grad(gm: fx.GraphModule, params, frozen) -> frozenset[str]:
    """Names of the values whose gradient backward computes: floating (or complex) values that
    depend on a trainable floating parameter (``params`` less ``frozen``) through ops
    that carry gradients, and that some output depends on."""
    out: set[str] = set()
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "get_attr":
            if n.target in params and n.target not in frozen and _carries_grad(v):
                out.add(n.name)
            continue
        if n.op != "call_function":
            continue
        if n.target is torch.ops.higher_order.wrap_with_set_grad_enabled and n.args and n.args[0] is False:
            continue
        if n.target in (aten.detach.default, aten.sym_size.int):
            continue
        if getattr(n.target, "_overloadpacket", None) in _FRESH:
            continue        # a fresh tensor: a gradient reaches it only through an in-place write (below)
        floating = any(_carries_grad(t) for t in (v if isinstance(v, (list, tuple)) else [v]))
        if floating and any(a.name in out for a in n.all_input_nodes):
            out.add(n.name)
            if _writes_into(n):     # later users may read the written tensor (or its base) by name
                out.update(_aliased(n.args[0]))
    return frozenset(out & _live(gm))


def _live(gm: fx.GraphModule) -> set[str]:
    """The nodes an output depends on: backward reaches no other (LLaVA's vision
    tower computes a last layer whose output it never reads). An in-place write into a
    live tensor (or a view of one) is live though nothing reads its result by name
    (DeepSeek-V3's keys: ``k[..., nope:].copy_(k_rot)``, then ``k`` is read): found in
    a second sweep, after the tensor it writes is known live."""
    live: set[str] = set()
    while True:
        before = len(live)
        for n in reversed(gm.graph.nodes):
            if n.op == "output" or any(u.name in live for u in n.users) or \
                    (n.op == "call_function" and _writes_into(n) and any(a in live for a in _aliased(n.args[0]))):
                live.add(n.name)
        if len(live) == before:
            return live


def grad_syncs(walked: Walked) -> Walked:
    """Requires ``walked`` with its re-layouts; ensures the invariant above: each
    visit's ``arg_steps`` with its ``copy_to`` edges, ``param_sync`` (parameter -> axes
    its gradient is all-reduced over after backward) and, at a use partial over more
    axes than the parameter's other uses, a ``grad_sums`` entry."""
    uses: dict = {}         # parameter -> [(node name, arg path, axes its grad is partial on)]
    walked = walked.with_visits(lambda v: _grad_steps(walked, v, uses))
    sums: dict = {}
    sync = {}
    for target, at in uses.items():
        # a parameter used several times may get partial gradients over different axes per
        # use (a tied table: lookup partial over the batch axes, head partial over fewer).
        # Sum what all uses share once after backward; a use partial over more axes gets an
        # in-graph copy_to for the extra ones
        common = frozenset.intersection(*[u[2] for u in at])
        sync[target] = set(common)
        for name, path, rep in at:
            extra = tuple(a for a in walked.mesh.axes if a in rep - common)
            if extra:
                sums.setdefault(name, []).append((path, Step(op="copy_to", axes=extra),
                                                  f"{target} grad summed over {','.join(extra)} here", target))
    return walked.with_visits(
        lambda v: evolve(v, grad_sums=tuple(sums.get(v.node.name, ()))), param_sync=sync)


def _grad_steps(walked: Walked, v: Visit, uses: dict) -> Visit:
    """``v`` with the grad invariant kept on its inputs: a replicated input of an op
    whose output is split / partial gets ``copy_to`` (a parameter: its after-backward sync)."""
    node, choice = v.node, v.choice
    # the op's own output: a step after it that cuts it (context parallelism's scatter)
    # keeps the op's gradient complete over those axes, its backward all-gathers
    out_axes = _spec_axes(before_cuts(choice))
    arg_steps = list(v.arg_steps)
    for path, req in v.in_specs.items():
        a = get_arg(node, path)
        if a.name not in walked.needs_grad or path in choice.grad_complete:
            continue
        rep = tuple(ax for ax in walked.mesh.axes if ax in out_axes and ax not in req.axes and ax not in req.partial)
        if path in choice.param_sync:
            rep = choice.param_sync[path]
        if a.op == "get_attr" and a.target in walked.params:
            # a use with a complete gradient counts too: a tied table's other use then
            # sums its partial part in the graph, not the complete one after backward
            uses.setdefault(a.target, []).append((node.name, path, frozenset(rep)))
            continue
        if not rep:
            continue
        steps = dict(arg_steps).get(path, ())
        last = steps[-1] if steps else None
        if last is not None and last.op == "gather" and tuple(last.axes) == tuple(rep):
            # gathered, then summed in backward over the same axes: one all-gather
            # whose backward reduce-scatters (1d-sp's input to a column block)
            steps = steps[:-1] + (dataclasses.replace(last, op="gather_partial"),)
        else:
            steps = steps + (Step(op="copy_to", axes=rep),)
        arg_steps = [(p, s) for p, s in arg_steps if p != path] + [(path, steps)]
    return evolve(v, arg_steps=tuple(arg_steps))


def _spec_axes(out) -> set:
    if isinstance(out, ShardSpec):
        return set(out.axes) | set(out.partial)
    if isinstance(out, tuple):
        s: set = set()
        for o in out:
            s |= _spec_axes(o)
        return s
    return set()
