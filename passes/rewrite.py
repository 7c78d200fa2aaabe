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

from autoshard.runtime import collectives as C
from autoshard.runtime import parallel_ops, selfcheck
from autoshard.ir.argpath import apply_patches, get_arg, set_arg
from autoshard.runtime.groups import axes_label
from autoshard.ir.mesh import Mesh
from autoshard.ir.plan import ShardingPlan, Step

from .experts import dispatch_experts

__all__ = ["rewrite", "slice_params"]


def _step_node(graph: fx.Graph, x: fx.Node, st: Step, groups: dict) -> fx.Node:
    group = groups[axes_label(st.axes)] if st.axes else None
    return graph.call_function(parallel_ops.step, (x, st.op, group, st.dim, st.segments, st.factor))


def slice_params(gm: fx.GraphModule, plan: ShardingPlan, mesh: Mesh, rank: int) -> None:
    """Replace each of ``plan``'s tensors in ``gm`` (every name of it) by this rank's slice, a
    Parameter (meta where the whole one is) that requires a gradient as the plan's
    ``trainable`` says (the model's flag at planning time, whatever module ``gm`` was captured from)."""
    for pp in plan.params:
        full = gm.get_parameter(pp.name)
        # a tensor the graph holds at its Hugging Face shape and the plan pads (experts held in
        # copies: docs/design.md, "Expert parallelism") is padded first; a padded width is already
        local = nn.Parameter(pp.spec.local(pp.pad(full.detach()), mesh, rank), requires_grad=pp.trainable) \
            if full.device.type != "meta" else nn.Parameter(
                torch.empty(pp.spec.local_shape(pp.global_shape if tuple(full.shape) == pp.hf_shape else full.shape,
                                                mesh), dtype=full.dtype, device="meta"),
                requires_grad=pp.trainable)
        for name in (pp.name,) + pp.aliases:
            mod_path, _, attr = name.rpartition(".")
            setattr(gm.get_submodule(mod_path) if mod_path else gm, attr, local)


def _gather_in_compute_dtype(graph: fx.Graph) -> None:
    """Mark each gather step whose every reader is a product autocast runs in its compute
    dtype (an ATen matmul / linear / conv, or a kernel that casts its operands itself):
    under autocast the step casts first and gathers half the bytes, the readers seeing
    the values they would have cast to (docs/design.md, "Mixed precision"). Without
    autocast the mark does nothing."""
    readers = parallel_ops.AUTOCAST_PRODUCTS | parallel_ops.casting_kernels()
    for node in graph.nodes:
        if node.target is parallel_ops.step and node.args[1] in ("gather", "gather_partial") and node.users \
                and all(u.op == "call_function" and u.target in readers for u in node.users):
            node.kwargs = {**node.kwargs, "wire": True}


def rewrite(gm: fx.GraphModule, plan: ShardingPlan, *, rank: int, groups: dict[str, str],
            copy_module: bool = True) -> fx.GraphModule:
    """Return this rank's module. ``groups`` maps an axes label (``"dep,row"``) to
    the c10d name of this rank's process group over those axes."""
    if copy_module:
        gm = copy.deepcopy(gm)
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    slice_params(gm, plan, plan.mesh, rank)
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
            cur = get_arg(node, path)
            key = (cur.name, tuple(steps))
            if key not in shared:
                with graph.inserting_before(node):
                    for st in steps:
                        cur = _step_node(graph, cur, st, groups)
                shared[key] = cur
            set_arg(node, path, shared[key])
        apply_patches(node, np_.patches)
        target = node
        if np_.kernel:
            fn, args, kwargs = parallel_ops.bind(np_.kernel, node, lambda axes: groups[axes_label(axes)],
                                               lambda axes: C.group_rank_size(groups[axes_label(axes)])[1])
            with graph.inserting_before(node):
                new = graph.call_function(fn, args, kwargs)
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            target = new
        last = target
        if np_.post:
            users = [u for u in target.users if u.op != "call_module"]
            cur = target
            for st in np_.post:
                with graph.inserting_after(cur):
                    cur = _step_node(graph, cur, st, groups)
            for u in users:
                u.replace_input_with(target, cur)
            last = cur
        if target.op == "call_function" and np_.out_spec is not None:
            # the runtime self-check's promise: the value's global (capture) shape and its spec
            last.meta[selfcheck.META] = (np_.name, np_.out_spec, target.meta.get("val"))
    _gather_in_compute_dtype(graph)
    # dtype checks baked in at capture would pin the captured dtype: a module run
    # under autocast (or fed another dtype) must not fail them
    for node in list(graph.nodes):
        if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    dispatch_experts(gm, plan, groups)      # expert parallelism: rows to their experts' ranks and back
    return gm
