"""Rewrite the captured graph for one rank: local parameter slices, parallel
kernels in place of heavy ops, re-layout collectives on edges, local sizes in
view / expand / split arguments, and the batch slice after batch inputs.

The rewrite does what the plan says and nothing else: it takes no decision, so
every rank emits the same sequence of collectives.
"""

from __future__ import annotations

import copy

import torch
from torch import fx, nn

from autoshard import collectives as C
from autoshard import kernels as K
from autoshard.groups import axes_label
from autoshard.mesh import Mesh
from autoshard.plan import ShardingPlan, Step
from autoshard.policies.linear_ops import linear_operands

__all__ = ["rewrite", "axes_label", "kernel_call", "apply_patches"]


def _get(node: fx.Node, path):
    if path[0] == "kw":
        return node.kwargs[path[1]]
    a = node.args[path[0]]
    return a if len(path) == 1 else a[path[1]]


def _set(node: fx.Node, path, value) -> None:
    if path[0] == "kw":
        kw = dict(node.kwargs)
        kw[path[1]] = value
        node.kwargs = kw
        return
    args = list(node.args)
    if len(path) == 1:
        args += [None] * (path[0] + 1 - len(args))      # an omitted optional argument (slice's end)
        args[path[0]] = value
    else:
        inner = list(args[path[0]])
        inner[path[1]] = value
        args[path[0]] = inner
    node.args = tuple(args)


def _step_node(graph: fx.Graph, x: fx.Node, st: Step, groups: dict) -> fx.Node:
    group = groups[axes_label(st.axes)] if st.axes else None
    return graph.call_function(K.step, (x, st.op, group, st.dim, st.segments, st.factor))


def _slice_params(gm: fx.GraphModule, plan: ShardingPlan, mesh: Mesh, rank: int) -> None:
    for pp in plan.params:
        full = gm.get_parameter(pp.name)
        local = nn.Parameter(pp.spec.local(full.detach(), mesh, rank), requires_grad=full.requires_grad) \
            if full.device.type != "meta" else nn.Parameter(
                torch.empty(pp.spec.local_shape(full.shape, mesh), dtype=full.dtype, device="meta"),
                requires_grad=full.requires_grad)
        for name in (pp.name,) + pp.aliases:
            mod_path, _, attr = name.rpartition(".")
            setattr(gm.get_submodule(mod_path) if mod_path else gm, attr, local)


def kernel_call(node, np_, group, size) -> tuple:
    """``(function, args, kwargs)`` that compute ``node`` with the plan's kernel.
    ``node`` is an fx node or anything with its ``target`` / ``args`` / ``kwargs``;
    ``group(axes)`` names the process group over ``axes`` and ``size(axes)`` gives
    its size (the rewrite passes c10d names; :mod:`autoshard.activations` passes
    shape-only groups)."""
    ka, k = np_.kernel_args, np_.kernel
    G = lambda axes: group(axes) if axes else None  # noqa: E731
    if k in ("row_linear", "summa", "partial_head", "three_d"):
        xp, wp, bp, nd, kd = linear_operands(node)
        x, w = _get(node, xp), _get(node, wp)
        b = _get(node, bp) if bp else None
        if k == "row_linear":
            return K.row_linear, (x, w, b), {"group": G(ka["axes"]), "n_dim": nd}
        if k == "summa":
            return K.summa, (x, w, b), {"row": G(ka["row_axes"]), "col": G(ka["col_axes"]), "n_dim": nd, "k_dim": kd}
        if k == "three_d":
            return K.three_d, (x, w, b), {"a": G(ka["a"]), "b": G(ka["b"]), "c": G(ka["c"]),
                                          "row_dim": ka["row_dim"], "n_dim": nd, "segments": ka["segments"]}
        return K.partial_head, (x, w, b), {"col": G(ka["col_axes"])}
    if k == "vocab_embedding":
        pad = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
        return K.vocab_embedding, (node.args[0], node.args[1]), \
            {"group": G(ka["axes"]), "padding_idx": pad if pad is not None and pad >= 0 else None}
    if k == "dist_layer_norm":
        args = list(node.args) + [None] * 5
        return K.dist_layer_norm, (args[0], args[1], args[2], args[3], args[4] if args[4] is not None else 1e-5), \
            {"group": G(ka["axes"]), "count": size(ka["axes"])}
    if k == "cross_entropy":
        return K.cross_entropy, (node.args[0], node.args[1]), \
            {"vocab_group": G(ka["vocab_axes"]), "batch_group": G(ka["batch_axes"]),
             "ignore_index": ka["ignore_index"], "reduction": ka["reduction"]}
    raise ValueError(f"unknown kernel {k!r} for node {node}")


def apply_patches(node, patches) -> None:
    """Set the plan's literal patches (local sizes) in ``node``'s arguments."""
    for path, value in patches:
        if isinstance(value, dict):          # {"at": [[position, local size], ...]}
            sizes = list(_get(node, path))
            for j, v in value["at"]:
                sizes[j] = v
            value = sizes
        _set(node, path, value)


def _group_size(groups: dict, axes) -> int:
    return C.group_rank_size(groups[axes_label(axes)])[1]


def rewrite(gm: fx.GraphModule, plan: ShardingPlan, *, rank: int, groups: dict[str, str],
            copy_module: bool = True) -> fx.GraphModule:
    """Return this rank's module. ``groups`` maps an axes label (``"dep,row"``) to
    the c10d name of this rank's process group over those axes."""
    if copy_module:
        gm = copy.deepcopy(gm)
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    _slice_params(gm, plan, plan.mesh, rank)
    shared: dict = {}     # (value name, steps) -> node made for the first consumer
    for np_ in plan.nodes:
        if np_.name == "output":
            node = next(n for n in graph.nodes if n.op == "output")
        else:
            node = by_name[np_.name]
        # arguments: re-layout steps, then literal patches
        for path, steps in np_.arg_steps:
            if node.op == "output":
                outs = list(node.args[0])
                cur = outs[path[1]]
                with graph.inserting_before(node):
                    for st in steps:
                        cur = _step_node(graph, cur, st, groups)
                outs[path[1]] = cur
                node.args = (type(node.args[0])(outs) if not isinstance(node.args[0], list) else outs,)
                continue
            cur = _get(node, path)
            key = (cur.name, tuple(steps))
            if key not in shared:
                with graph.inserting_before(node):
                    for st in steps:
                        cur = _step_node(graph, cur, st, groups)
                shared[key] = cur
            _set(node, path, shared[key])
        apply_patches(node, np_.patches)
        target = node
        if np_.kernel:
            fn, args, kwargs = kernel_call(node, np_, lambda axes: groups[axes_label(axes)],
                                           lambda axes: _group_size(groups, axes))
            with graph.inserting_before(node):
                new = graph.call_function(fn, args, kwargs)
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            target = new
        if np_.post:
            users = [u for u in target.users if u.op != "call_module"]
            cur = target
            for st in np_.post:
                with graph.inserting_after(cur):
                    cur = _step_node(graph, cur, st, groups)
            for u in users:
                u.replace_input_with(target, cur)
    graph.lint()
    gm.recompile()
    return gm
