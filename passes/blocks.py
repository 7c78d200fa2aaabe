"""The model's blocks as modules again: each repeated block of a rewritten graph runs
inside the block's own module, which the graph calls.

A captured graph is flat: every parameter is read by a ``get_attr`` of the root, and
no submodule is ever called. Tools that work per block need the block to be entered
as a module: FSDP2 gathers a block's parameters in the block's forward pre-hook and
frees them after (``fully_shard`` per block, :mod:`autoshard.runtime.fsdp`).

Blocks are found as :mod:`autoshard.passes.remat` finds them (from the graph: the
nodes whose module stack passes through a numbered child, ``model.layers.3``).
Each block's nodes, and the reads of the parameters under its path that only it
uses, move into a graph module that replaces the block's holder module at the same
path and keeps the holder's children (the very modules that register the
parameters), so parameter names, ``state_dict()`` keys and every other graph that
reads through the path are unchanged. The root graph calls the block
(``call_module``) with the values it needs and takes the ones it gives back.

Example::

    from autoshard.passes.blocks import split_blocks
    keys = split_blocks(gm)      # e.g. ["model.layers.0", "model.layers.1"]
    gm.get_submodule(keys[0])    # a GraphModule the graph calls
"""

from __future__ import annotations

import functools

from torch import fx

from autoshard.ir.errors import ShardingError
from .remat import block_segments, outline, run_checkpointed

__all__ = ["split_blocks"]


def split_blocks(gm: fx.GraphModule, *, min_nodes: int = 4, checkpoint: bool = False) -> list[str]:
    """Move each block of ``gm`` into the block's own module (see the module doc), in
    place. Returns the block paths, in graph order ([] without numbered modules).
    ``checkpoint``: each block's forward runs under non-reentrant activation
    checkpointing (its activations recomputed in backward, inside whatever hooks wrap
    the block's call: FSDP2 gathers the block's parameters before it recomputes).
    Raises :class:`ShardingError` where a block's nodes are not one run of the graph
    (another block's or the root's nodes in between): it could not be entered once."""
    graph = gm.graph
    segs = [(k, nodes) for k, nodes in block_segments(graph) if len(nodes) >= min_nodes]
    seen: dict[str, int] = {}
    for key, _ in segs:
        seen[key] = seen.get(key, 0) + 1
    split = [k for k, n in seen.items() if n > 1]
    if split:
        raise ShardingError(f"block(s) {split[:3]} run in several pieces of the graph (other nodes in between), "
                            f"so they cannot be entered as one module each")
    keys = []
    for key, nodes in segs:
        inside = set(nodes)
        prefix = key + "."
        attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith(prefix)
                 and n.users and all(u in inside for u in n.users)]

        def install(sub, key=key):
            holder = gm.get_submodule(key)
            block = fx.GraphModule(holder, sub, class_name="Block")
            # the holder's own children (the modules that register the parameters), not copies
            for name, child in holder.named_children():
                block._modules[name] = child
            if checkpoint:
                block.forward = functools.partial(run_checkpointed, block.forward)
            parent_path, _, last = key.rpartition(".")
            (gm.get_submodule(parent_path) if parent_path else gm)._modules[last] = block
            return key
        if outline(gm, nodes, install, attrs=attrs, strip=prefix):
            keys.append(key)
    if keys:
        graph.lint()
        gm.recompile()
    return keys
