"""Inline the grad-mode blocks of an exported graph, for ``torch.compile`` with dynamic shapes.

``torch.export`` wraps a region run under ``torch.no_grad()`` (Llama's rotary
frequencies, for one) in the higher-order op ``wrap_with_set_grad_enabled(False,
submodule, *operands)``. Dynamo traces that op only when its body captures no
symbolic size; with a dynamic sequence the body reads one, and dynamo breaks the
graph there ("wrap_with_set_grad_enabled: unexpected freevars"). :func:`inline_grad_blocks`
returns a copy of the graph module in which each such call is its body between two
``torch._C._set_grad_enabled`` calls (the mode set, then restored to what it was),
which dynamo traces with any shape: one graph for every batch and sequence length.
Same results and gradients: the body runs under the same grad mode.

The eager graph keeps its blocks (the planner, the tracer of activations and the
self-check read them as one node); :meth:`autoshard.ShardedModule.compile` compiles
this copy.

    >>> import torch
    >>> from torch import fx
    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         with torch.no_grad():
    ...             y = x * 2
    ...         return x + y
    >>> blocks = lambda g: sum(n.target is torch.ops.higher_order.wrap_with_set_grad_enabled for n in g.graph.nodes)
    >>> ep = torch.export.export(M(), (torch.ones(2, requires_grad=True),))
    >>> gm = inline_grad_blocks(ep.module())
    >>> blocks(ep.module()), blocks(gm)
    (1, 0)
    >>> x = torch.ones(2, requires_grad=True)
    >>> gm(x).sum().backward(); x.grad.tolist()           # y = 2x has no gradient, as under no_grad
    [1.0, 1.0]
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import fx

__all__ = ["inline_grad_blocks"]

_BLOCK = torch.ops.higher_order.wrap_with_set_grad_enabled


def inline_grad_blocks(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its parameters and buffers) with every
    ``wrap_with_set_grad_enabled`` call inlined; ``gm`` itself when it has none."""
    if not any(n.op == "call_function" and n.target is _BLOCK for n in gm.graph.nodes):
        return gm
    graph = fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls)
    graph._codegen = copy.deepcopy(gm.graph._codegen)      # export's pytree in/out specs
    out, node = graph.graph_copy(gm.graph, {}, return_output_node=True)   # metas copied shallowly
    graph.output(out, type_expr=node.type).meta = dict(node.meta)
    new = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    new.meta = dict(getattr(gm, "meta", {}))
    graph = new.graph
    while True:
        node = next((n for n in graph.nodes if n.op == "call_function" and n.target is _BLOCK), None)
        if node is None:
            break
        enabled, body_ref, *operands = node.args
        body = new.get_submodule(body_ref.target)
        with graph.inserting_before(node):
            prev = graph.call_function(torch.is_grad_enabled, ())
            graph.call_function(torch._C._set_grad_enabled, (enabled,))
            # the body's inputs are the block's operands; its own attributes are copied onto the module
            env = dict(zip((b for b in body.graph.nodes if b.op == "placeholder"), operands))
            for b in body.graph.nodes:
                if b.op == "get_attr":
                    name = f"{body_ref.target}_{b.target}".replace(".", "_")
                    setattr(new, name, functools.reduce(getattr, b.target.split("."), body))
                    env[b] = graph.get_attr(name)
            result = graph.graph_copy(body.graph, env)
            graph.call_function(torch._C._set_grad_enabled, (prev,))
        if isinstance(result, (list, tuple)):      # the block's users index the tuple it returns
            for user in list(node.users):
                user.replace_all_uses_with(result[user.args[1]])
                graph.erase_node(user)
        else:
            node.replace_all_uses_with(result)
        graph.erase_node(node)
        if not body_ref.users:
            graph.erase_node(body_ref)
    graph.lint()
    new.recompile()
    return new
