"""Activation checkpointing on a captured (or rewritten) graph: each repeated
block is moved into a submodule run under :func:`torch.utils.checkpoint.checkpoint`,
so backward keeps only the block's inputs and recomputes the rest.

A block is found from the graph, not from class names: the nodes whose module
stack passes through a numbered child (``model.layers.3``, ``encoder.layer.0``,
``h.11`` — any ``ModuleList`` entry) form one block, keyed by that path. Nodes the
rewrite inserted (re-layout collectives) carry no stack and join the block of the
node before them. Parameters stay in the outer module and enter the block as
inputs, so the ShardedModule's parameter names do not change.

Recomputation re-runs the block's forward collectives during backward; every
rank runs the same graph, so the order is the same on every rank.

Example::

    from autoshard.passes.remat import checkpoint_blocks
    n = checkpoint_blocks(gm)      # gm: an fx.GraphModule from autoshard capture/rewrite
    # n blocks now recompute their activations in backward
"""

from __future__ import annotations

import operator
import re

import torch
import torch.utils.checkpoint
from torch import fx, nn

__all__ = ["checkpoint_blocks", "block_key", "block_segments", "outline", "run_checkpointed"]

_NUMBERED = re.compile(r"(^|\.)\d+$")


def block_key(node: fx.Node) -> str | None:
    """The outermost numbered module path in the node's module stack, or None."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in stack.values():
        if isinstance(path, str) and _NUMBERED.search(path):
            return path
    return None


def run_checkpointed(fn, *args):
    """``fn(*args)`` under non-reentrant checkpointing while gradients are on (RNG state
    kept, so dropout recomputes the same mask); a plain call otherwise."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


class _Checkpointed(nn.Module):
    """Runs ``block`` under non-reentrant checkpointing (RNG state preserved, so
    dropout recomputes the same mask)."""

    def __init__(self, block: fx.GraphModule, key: str):
        super().__init__()
        self.block = block
        self.key = key

    def forward(self, *args):
        return run_checkpointed(self.block, *args)

    def extra_repr(self) -> str:
        return f"block={self.key!r}"


def block_segments(graph: fx.Graph) -> list[tuple[str, list[fx.Node]]]:
    """Maximal runs of consecutive compute nodes with the same block key."""
    out: list[tuple[str, list[fx.Node]]] = []
    current = None
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        key = block_key(node) if node.meta.get("nn_module_stack") else current
        current = key
        if key is None:
            continue
        if out and out[-1][0] == key and _only_placeholders_or_attrs_between(out[-1][1][-1], node):
            out[-1][1].append(node)
        else:
            out.append((key, [node]))
    return out


def _only_placeholders_or_attrs_between(a: fx.Node, b: fx.Node) -> bool:
    n = a.next
    while n is not b:
        if n.op not in ("get_attr", "placeholder"):
            return False
        n = n.next
    return True


def outline(gm: fx.GraphModule, nodes: list[fx.Node], install, *, attrs=(), strip: str = "") -> bool:
    """Replace ``nodes`` (one run of ``gm``'s graph) by a call of a module: ``install(sub)``
    gets the run as a graph of its own (its inputs as placeholders ``in_i``, the
    ``get_attr`` nodes in ``attrs`` moved inside with ``strip`` cut from their targets,
    the values used after it as one output tuple), puts a module for it into ``gm`` and
    returns the module's path; the graph then calls that module and takes its outputs.
    Returns False (nothing changed) when nothing of the run is used after it."""
    graph = gm.graph
    inside = set(nodes)
    moved = inside | set(attrs)
    inputs: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in moved and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    if not outputs:
        return False
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, a in enumerate(inputs):
        env[a] = sub.placeholder(f"in_{i}")
        env[a].meta = dict(a.meta)
    for a in attrs:
        env[a] = sub.get_attr(a.target[len(strip):])
        env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    target = install(sub)
    with graph.inserting_after(nodes[-1]):       # every input is defined by now
        call = graph.call_module(target, tuple(inputs))
        call.meta = {}
    outs = []
    prev = call
    for i, o in enumerate(outputs):
        with graph.inserting_after(prev):
            prev = graph.call_function(operator.getitem, (call, i))
        prev.meta = dict(o.meta)
        outs.append(prev)
    for o, g in zip(outputs, outs):
        o.replace_all_uses_with(g, delete_user_cb=lambda u: u not in inside)
    for n in reversed(nodes):
        graph.erase_node(n)
    for a in attrs:
        graph.erase_node(a)
    return True


def checkpoint_blocks(gm: fx.GraphModule, *, min_nodes: int = 4) -> int:
    """Wrap every block of ``gm`` (see module docstring) in activation
    checkpointing, in place. Returns the number of blocks wrapped (0 when the
    graph has no numbered modules: nothing changes)."""
    n_done = 0
    for key, nodes in block_segments(gm.graph):
        if len(nodes) < min_nodes:
            continue

        def install(sub, key=key, name=f"_remat_{n_done}"):
            # no get_attr inside: parameters arrive as inputs
            gm.add_module(name, _Checkpointed(fx.GraphModule(gm, sub), key))
            return name
        if outline(gm, nodes, install):
            n_done += 1
    if n_done:
        gm.graph.lint()
        gm.recompile()
    return n_done
