"""Pipeline stages cut from a rewritten graph, between transformer blocks.

The model's blocks are found from the graph, as :mod:`autoshard.passes.remat` finds
them: the nodes whose module stack passes through a numbered child (``model.layers.3``,
``h.11``: any ``ModuleList`` entry), in graph order. :func:`balance` groups consecutive
blocks into stages of about equal cost (the cost model's time per block, the
embedding's cost on the first stage, the head's and the loss's on the last), keeping
every block whole. :func:`cut` then splits the graph at the first node of each stage's
first block: a node runs on the stage its position falls in (the graph's order is a
topological one, so no node needs a later stage's value).

What crosses a cut is explicit. A tensor computed on stage ``t`` and used on stage
``s > t`` (the residual stream, rotary cos/sin, the attention mask, position ids)
becomes an output of stages ``t .. s-1`` and an input of stages ``t+1 .. s`` (passed
through the stages between). A value that is not a tensor (a symbolic size, a tuple)
cannot travel point-to-point: the nodes that compute it are copied into the stage that
uses it, with their own tensor operands carried. Parameters are read where they are used:
a tensor read on two stages (tied embedding and head) is held by both, and its gradient
is the sum of the two stages' (:mod:`autoshard.pipeline_parallel` sums them each step).

Every stage takes the model's inputs by name (the batch's tensors go to each stage)
and its carried tensors positionally, first; the last stage returns the graph's outputs.

Example::

    from autoshard.passes.stages import blocks_in_order, cut
    keys = blocks_in_order(gm.graph)            # ["model.layers.0", "model.layers.1"]
    stages = cut(gm, [keys[1]])                 # two stages: layers.0 | layers.1
    stages[1].carried_in                        # e.g. ("embedding", "to_5", "to_6", ...)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from torch import fx

from autoshard.ir.errors import ConfigError, ShardingError

from .remat import block_key, block_segments, checkpoint_blocks

__all__ = ["Stage", "blocks_in_order", "balance", "checkpoint_stages", "cut", "needs_grad"]

_MISSING = object()


@dataclass
class Stage:
    """One pipeline stage's graph: ``gm(*inputs, *carried)`` with ``inputs`` the captured
    graph's flat inputs (in its placeholder order) and ``carried`` the tensors the stage
    before sent; returns the tensors for the next stage (``carried_out``), or the graph's
    flat outputs on the last stage."""

    index: int
    gm: fx.GraphModule
    blocks: tuple[str, ...]             # the block paths whose nodes run here
    carried_in: tuple[str, ...]         # names (in the cut graph) of the tensors received, in order
    carried_out: tuple[str, ...]        # names of the tensors sent on (empty on the last stage)
    tensors: tuple[str, ...]            # the get_attr targets (parameters, buffers) the stage reads
    grad_in: tuple[str, ...] = ()       # the carried_in whose value needs a gradient (it is sent back)


def blocks_in_order(graph: fx.Graph, min_nodes: int = 4) -> list[str]:
    """The block paths of ``graph`` (numbered modules with at least ``min_nodes`` compute
    nodes), in the order their first node runs."""
    seen: dict[str, int] = {}
    for key, nodes in block_segments(graph):
        seen[key] = seen.get(key, 0) + len(nodes)
    return [k for k, n in seen.items() if n >= min_nodes]


def balance(costs: list[float], stages: int, head: float = 0.0, tail: float = 0.0, *,
            memory: list[float] | None = None, mem_head: float = 0.0, mem_tail: float = 0.0,
            limit: float | None = None) -> tuple[int, ...]:
    """Cut ``len(costs)`` consecutive blocks into ``stages`` non-empty runs whose largest
    cost (``head`` added to the first run, ``tail`` to the last) is the least possible;
    returns the index of the first block of each run (the first is 0). With ``memory``
    (bytes per block, ``mem_head`` / ``mem_tail`` on the first / last run) and ``limit``,
    only cuts whose every run fits in ``limit`` are taken (:class:`ConfigError` if none).

        >>> balance([1, 1, 1, 1], 2)
        (0, 2)
        >>> balance([1, 1, 1, 1], 2, head=2.5)      # the embedding's cost weighs on stage 0
        (0, 1)
        >>> balance([1, 1, 1, 1], 2, head=2.5, memory=[1, 1, 1, 1], limit=2)   # time yields to memory
        (0, 2)
    """
    n = len(costs)
    if stages < 1 or stages > n:
        raise ConfigError(f"{stages} pipeline stages need at least {stages} transformer blocks; the model has {n}: "
                          f"use pp (× interleaved stages per rank) <= {n}")
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + float(c))

    mem = [0.0]
    for m in memory or [0.0] * n:
        mem.append(mem[-1] + float(m))

    def run(i: int, j: int) -> float:       # blocks i..j-1 as one stage
        if limit is not None and mem[j] - mem[i] + (mem_head if i == 0 else 0.0) + (mem_tail if j == n else 0.0) > limit:
            return float("inf")
        return pre[j] - pre[i] + (head if i == 0 else 0.0) + (tail if j == n else 0.0)

    # best[k][j]: the least largest cost of blocks 0..j-1 in k runs; ties go to the earliest cut
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], run(i, j))
                if v < best[k][j] - 1e-12 * max(1.0, abs(v)):
                    best[k][j], arg[k][j] = v, i
    if best[stages][n] == float("inf"):
        raise ConfigError(f"no cut of {n} blocks into {stages} pipeline stages fits {limit / 2**30:.2f} GiB per rank "
                          f"(parameters, gradients, optimizer state and the activations in flight): use more stages, "
                          f"more tensor-parallel ranks per stage, or a smaller micro-batch")
    starts, j = [], n
    for k in range(stages, 0, -1):
        i = arg[k][j]
        starts.append(i)
        j = i
    return tuple(reversed(starts))


def _is_tensor(n: fx.Node) -> bool:
    """Whether ``n``'s value is a tensor. Nodes the rewrite inserted (re-layout steps)
    carry no value and are tensors; a symbolic size or a tuple is not."""
    v = n.meta.get("val", _MISSING)
    return v is _MISSING or isinstance(v, torch.Tensor)


# ops whose floating output never carries a gradient (autograd gives it none)
_NO_GRAD = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "new_zeros",
                      "new_ones", "new_empty", "new_full", "detach", "alias_copy", "lift_fresh_copy"})


def _floating(v) -> bool:
    if v is _MISSING:
        return True         # a node the rewrite inserted: it passes its operand's value on
    if isinstance(v, torch.Tensor):
        return v.is_floating_point() or v.is_complex()
    return isinstance(v, (tuple, list)) and any(_floating(x) for x in v)


def needs_grad(gm: fx.GraphModule) -> set:
    """The nodes of ``gm`` whose value needs a gradient: downstream of a parameter that
    requires one, through ops with a floating output (autograd's rule; an index, a mask or
    rotary tables made from buffers need none). What crosses a cut and is in this set is
    what torch's engine sends a gradient back for.

        >>> import torch
        >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
        >>> sorted(n.name for n in needs_grad(gm))
        ['bias', 'linear', 'weight']
    """
    params = {n for n, t in gm.named_parameters(remove_duplicate=False) if t.requires_grad}
    out: set = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            if n.target in params:
                out.add(n)
        elif n.op not in ("placeholder", "output"):
            name = getattr(getattr(n.target, "_overloadpacket", n.target), "__name__", str(n.target))
            if name not in _NO_GRAD and _floating(n.meta.get("val", _MISSING)) and \
                    any(a in out for a in n.all_input_nodes):
                out.add(n)
    return out


def cut(gm: fx.GraphModule, openers: list[str]) -> list[Stage]:
    """Split ``gm`` into ``len(openers) + 1`` stages, stage ``i + 1`` opening at the first
    node of block ``openers[i]`` (see the module doc). ``gm`` is not changed; every stage
    reads the very parameter and buffer tensors of ``gm``."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    cuts = _cut_points(nodes, openers)
    n_stages = len(cuts) + 1
    last = n_stages - 1
    out_node = next(n for n in nodes if n.op == "output")
    compute = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
    owner = {n: bisect.bisect_right(cuts, pos[n]) for n in compute}
    needs = [_needs(compute, owner, s, out_node if s == last else None) for s in range(n_stages)]
    carried = []        # carried[s]: the tensors stage s sends to s + 1
    for s in range(last):
        later = set().union(*needs[s + 1:])
        carried.append(sorted((v for v in later if owner[v] <= s), key=pos.__getitem__))
    inputs = [n for n in nodes if n.op == "placeholder"]
    grad = needs_grad(gm)
    return [_stage(gm, s, inputs, compute, owner, carried[s - 1] if s else [],
                   carried[s] if s < last else None, out_node, grad) for s in range(n_stages)]


def _cut_points(nodes: list, openers: list[str]) -> list[int]:
    """The graph position of each opener block's first node, in graph order."""
    cuts = []
    for key in openers:
        first = next((i for i, n in enumerate(nodes) if n.op == "call_function" and n.meta.get("nn_module_stack")
                      and block_key(n) == key), None)
        if first is None:
            raise ShardingError(f"pipeline cut: block {key!r} has no node in the graph")
        cuts.append(first)
    if cuts != sorted(set(cuts)):
        raise ShardingError(f"pipeline cut: the blocks {openers} do not open in graph order")
    return cuts


def _needs(compute: list, owner: dict, s: int, out_node) -> set:
    """What stage ``s`` needs from earlier ones: tensors (carried), through the operands
    of the non-tensor values it recomputes (``out_node``: the graph's output, read by the
    last stage)."""
    need: set = set()
    seen: set = set()

    def visit(a):
        if a.op in ("placeholder", "get_attr") or owner[a] == s:
            return
        if _is_tensor(a):
            need.add(a)
        elif a not in seen:
            seen.add(a)
            for b in a.all_input_nodes:
                visit(b)
    for n in compute:
        if owner[n] == s:
            for b in n.all_input_nodes:
                visit(b)
    if out_node is not None:
        for b in out_node.all_input_nodes:
            visit(b)
    return need


def _stage(gm, s: int, inputs: list, compute: list, owner: dict, received: list, sends: list | None,
           out_node, grad: set) -> Stage:
    """Stage ``s``'s graph: the inputs, the tensors it ``received``, its own nodes, and as
    output the tensors it ``sends`` on (None: the last stage, the graph's output); ``grad``:
    the nodes whose value needs a gradient (:func:`needs_grad`)."""
    g = fx.Graph()
    env: dict = {}
    for p in inputs:
        env[p] = g.placeholder(p.name)
        env[p].meta = dict(p.meta)
    for v in received:
        env[v] = g.placeholder(f"carried_{v.name}")
        env[v].meta = dict(v.meta)
    attrs: list[str] = []

    def get(a):
        if a in env:
            return env[a]
        if a.op == "get_attr":
            env[a] = g.get_attr(a.target)
            env[a].meta = dict(a.meta)
            attrs.append(a.target)
        elif a.op != "placeholder" and owner[a] < s and not _is_tensor(a):
            env[a] = g.node_copy(a, get)        # a symbolic size or tuple: computed again here
        else:
            raise ShardingError(f"pipeline cut: stage {s} reads {a.name} ({a.op}), computed on stage "
                                f"{owner.get(a)} and not carried", node=a)
        return env[a]
    for n in compute:
        if owner[n] == s:
            env[n] = g.node_copy(n, get)
    if sends is None:
        g.output(fx.node.map_arg(out_node.args[0], get))
    else:
        g.output(tuple(get(v) for v in sends))
    g.lint()
    sgm = fx.GraphModule(gm, g, class_name=f"Stage{s}")
    blocks = tuple(dict.fromkeys(block_key(n) for n in compute if owner[n] == s and n.meta.get("nn_module_stack")
                                 and block_key(n) is not None))
    return Stage(index=s, gm=sgm, blocks=blocks, carried_in=tuple(v.name for v in received),
                 carried_out=tuple(v.name for v in sends) if sends is not None else (),
                 tensors=tuple(attrs), grad_in=tuple(v.name for v in received if v in grad))


def checkpoint_stages(stages: list[Stage]) -> int:
    """Activation checkpointing inside every stage: each block of a stage's graph runs
    under non-reentrant checkpointing (:func:`autoshard.passes.remat.checkpoint_blocks`),
    so a stage keeps only its blocks' inputs per micro-batch in flight and recomputes
    the rest in its backward (its collectives too, in the same order on every rank of the
    stage). A stage's inputs, outputs and parameters do not change. Returns the blocks
    wrapped, over all stages."""
    return sum(checkpoint_blocks(st.gm) for st in stages)
