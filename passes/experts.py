"""Grouped (per-expert) matmuls with a parameter operand become Linear-like nodes.

A mixture-of-experts layer exported by Hugging Face runs its experts as one
grouped matmul: the routed tokens, sorted by expert, times a 3-D weight
``[E, k, n]`` whose group ``e`` multiplies the rows ``offs[e-1]:offs[e]``
(``aten._grouped_mm``, or transformers' ``grouped_mm_fallback`` custom op on
CPU). The weight reaches the op through a ``transpose`` of the stored parameter
(``[E, n, k]``, the ``nn.Linear`` layout per expert), so the planner, which
splits a parameter where it is consumed, would see a view and leave the
experts whole.

This pass folds ``op(x, transpose(P, -2, -1), offs)`` (or ``op(x, P, offs)``)
into :func:`~autoshard.ir.grouped.grouped_linear` ``(x, P, offs, transposed, impl)`` with the
parameter as a direct operand. Annotation then counts it as a ``linear`` (it
appears in the plan table like any Linear), and the Linear rules split its
output features (column) or its input features (row) per expert, as for a
dense MLP: Megatron-style expert tensor parallelism. The graph computes the
same values: ``grouped_linear`` calls the op it replaced.

    >>> import transformers
    >>> from autoshard.passes.capture import capture
    >>> cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...     num_attention_heads=4, num_key_value_heads=4, vocab_size=64, num_local_experts=4)
    >>> cap = fold_grouped_weights(capture(transformers.MixtralForCausalLM(cfg)))
    >>> sorted(n.args[1].target for n in cap.module.graph.nodes if n.target is grouped_linear)
    ['model.layers.0.mlp.experts.down_proj', 'model.layers.0.mlp.experts.gate_up_proj']
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
from torch import fx

from autoshard.ir.grouped import grouped_linear, grouped_ops

from .capture import Captured, copy_sharing, fold_nodes

aten = torch.ops.aten

__all__ = ["fold_grouped_weights", "count_on_floats", "ExpertSegment", "expert_segments", "ep_axes",
           "plan_expert_parallel", "dispatch_experts", "mode_layout"]


def _param_operand(w, params: set[str]) -> tuple[fx.Node, bool] | None:
    """The parameter behind ``w`` and whether ``w`` is its transpose over the last two dims."""
    if isinstance(w, fx.Node) and w.op == "get_attr" and w.target in params:
        return w, False
    if isinstance(w, fx.Node) and w.target == aten.transpose.int and len(w.args) == 3:
        p, a, b = w.args
        if isinstance(p, fx.Node) and p.op == "get_attr" and p.target in params and \
                {a % 3, b % 3} == {1, 2} and p.meta["val"].dim() == 3:
            return p, True
    return None


def fold_grouped_weights(cap: Captured) -> Captured:
    """``cap`` with every grouped matmul whose weight is a parameter (or its transpose)
    rewritten as :func:`grouped_linear`; the same ``cap`` where there is none. ``cap``
    itself is not changed: the result holds a copy of the graph module sharing
    every parameter."""
    ops = {v: k for k, v in grouped_ops().items()}
    gm = cap.module
    params = {n for n, _ in gm.named_parameters(remove_duplicate=False)}

    def foldable(n):
        return n.op == "call_function" and n.target in ops and len(n.args) >= 3 and \
            n.args[2] is not None and _param_operand(n.args[1], params) is not None and \
            not n.args[3:] and not n.kwargs.get("bias") and n.kwargs.get("out_dtype") is None

    def fold(n):
        p, transposed = _param_operand(n.args[1], params)
        return grouped_linear, (n.args[0], p, n.args[2], transposed, ops[n.target])

    return fold_nodes(cap, foldable, fold)


def _integer_histc(n: fx.Node) -> bool:
    v = n.args[0].meta.get("val") if n.target is aten.histc.default and isinstance(n.args[0], fx.Node) else None
    return isinstance(v, torch.Tensor) and not v.is_floating_point()


def count_on_floats(cap: Captured) -> Captured:
    """``cap`` with every ``histc`` of integers given its input cast to float first.

    Transformers' MoE routing counts tokens per expert with ``histc`` on integers when
    the device is not a CPU, floats on a CPU; a model captured on the meta device (a
    plan, a new input signature, a generation step) takes the integer branch, which
    the CPU kernel refuses. Exact for counts below 2**24. The same ``cap`` where there
    is none; ``cap`` itself is not changed."""
    if not any(_integer_histc(n) for n in cap.module.graph.nodes):
        return cap
    new = copy_sharing(cap.module)
    g = new.graph
    for n in list(g.nodes):
        if _integer_histc(n):
            with g.inserting_before(n):
                f = g.call_function(aten._to_copy.default, (n.args[0],), {"dtype": torch.float32})
            f.meta["val"] = n.args[0].meta["val"].float()
            n.args = (f,) + tuple(n.args[1:])
    g.lint()
    new.recompile()
    return dataclasses.replace(cap, module=new)


# ------------------------------------------------------------ expert parallelism
# docs/design.md, "Expert parallelism": the experts' weights cut on the expert dim over the
# ep ranks (dp, and cp, ranks), the token rows moved to them and back. Found from the graph:
# the grouped matmuls sharing one group-offsets operand and the row-wise ops between them.


@dataclasses.dataclass(frozen=True)
class ExpertSegment:
    """One mixture-of-experts layer's expert computation in a graph: the grouped matmuls
    (``grouped``) that share the group offsets ``offs``, every node between them
    (``nodes``: on a path from one grouped matmul to another, in graph order), the
    row-aligned tensors they take from outside (``rows``: the sorted token rows first,
    then e.g. per-row biases gathered by expert), and the nodes whose values leave it
    (``exits``). Each node maps a row to a row of the same expert, so the segment can run
    on any subset of the rows as long as the offsets count them."""

    offs: fx.Node
    grouped: tuple
    nodes: tuple
    rows: tuple
    exits: tuple

    @property
    def weights(self) -> tuple[str, ...]:
        """The experts' parameters (each ``[E, ...]``), by name."""
        return tuple(dict.fromkeys(g.args[1].target for g in self.grouped))

    @property
    def num_experts(self) -> int:
        return int(self.grouped[0].args[1].meta["val"].shape[0])


def _row_count(n) -> str | None:
    """A value's rows (its first dim, as a string: symbolic in a captured graph); a
    re-layout step of the rewrite (no value of its own) keeps its input's."""
    if isinstance(n, fx.Node) and "val" not in n.meta and _is_step(n):
        return _row_count(n.args[0])
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return str(v.shape[0]) if isinstance(v, torch.Tensor) and v.dim() >= 1 else None


def _is_check(n: fx.Node) -> bool:
    """A metadata assertion export leaves on a value (the rewrite drops those without users)."""
    return n.op == "call_function" and getattr(n.target, "__name__", "").startswith("_assert")


def _is_step(n: fx.Node) -> bool:
    """A re-layout step the rewrite inserted (:func:`autoshard.runtime.parallel_ops.step`)."""
    from autoshard.runtime import parallel_ops

    return n.op == "call_function" and n.target is parallel_ops.step


def _reach(starts, nexts) -> set:
    """Every node reached from ``starts`` by ``nexts`` (users, or inputs), one step or more."""
    seen: set = set()
    stack = list(starts)
    while stack:
        for m in nexts(stack.pop()):
            if m not in seen:
                seen.add(m)
                stack.append(m)
    return seen


def expert_segments(gm: fx.GraphModule) -> list[ExpertSegment]:
    """The expert segments of ``gm`` (see :class:`ExpertSegment`), in graph order.

    >>> import transformers
    >>> from autoshard.passes.capture import capture
    >>> cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...     num_attention_heads=4, num_key_value_heads=4, vocab_size=64, num_local_experts=4)
    >>> seg, = expert_segments(fold_grouped_weights(capture(transformers.MixtralForCausalLM(cfg))).module)
    >>> seg.num_experts, seg.weights, [g.name for g in seg.grouped], len(seg.rows), len(seg.exits)
    (4, ('model.layers.0.mlp.experts.gate_up_proj', 'model.layers.0.mlp.experts.down_proj'), ['grouped_linear', 'grouped_linear_1'], 1, 1)

    Raises:
        ShardingError: a node between two grouped matmuls is not row-wise (its value does
            not keep the token rows) or takes a tensor that is neither row-aligned nor an
            expert weight: the rows could not be moved to their experts' ranks exactly.
    """
    from autoshard.ir.errors import ShardingError

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_offs: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.target is grouped_linear and isinstance(n.args[1], fx.Node) and n.args[1].op == "get_attr":
            by_offs.setdefault(n.args[2], []).append(n)
    out = []
    for offs, grouped in by_offs.items():
        down = _reach(grouped, lambda n: n.users)
        up = _reach(grouped, lambda n: n.all_input_nodes)
        nodes = sorted(set(grouped) | (down & up), key=order.__getitem__)
        inside = set(nodes)
        rows = _row_count(grouped[0].args[0])
        weights = {g.args[1] for g in grouped}
        row_inputs = [grouped[0].args[0]]
        for n in nodes:
            if n not in grouped and n.target is not operator.getitem and not _is_step(n) and not _is_check(n):
                v = n.meta.get("val")
                outs = v if isinstance(v, (tuple, list)) else (v,)
                if not outs or any(not isinstance(t, torch.Tensor) or t.dim() < 1 or str(t.shape[0]) != rows
                                   for t in outs):
                    raise ShardingError(f"expert parallelism: `{n.name}` ({n.target}) between the grouped expert "
                                        f"matmuls does not keep the {rows} token rows (its value "
                                        f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}): "
                                        f"the rows cannot be computed on their experts' ranks; valid here: ep=1",
                                        node=n)
            if _is_step(n) and n.args[3] == 0:
                raise ShardingError(f"expert parallelism: a re-layout of the token rows (`{n.name}`) between the "
                                    f"grouped expert matmuls; valid here: ep=1", node=n)
            for a in n.all_input_nodes:
                if a in inside or a is offs or a in weights or a in row_inputs:
                    continue
                if _row_count(a) == rows:
                    row_inputs.append(a)
                    continue
                v = a.meta.get("val")
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    raise ShardingError(f"expert parallelism: `{n.name}` between the grouped expert matmuls takes "
                                        f"`{a.name}` {tuple(v.shape)}, neither a token row per row nor an expert "
                                        f"weight; valid here: ep=1", node=n)
        exits = tuple(n for n in nodes if any(u not in inside and not _is_check(u) for u in n.users))
        for n in exits:
            if _row_count(n) != rows:
                raise ShardingError(f"expert parallelism: `{n.name}` leaves the expert segment without its "
                                    f"{rows} token rows; valid here: ep=1", node=n)
        out.append(ExpertSegment(offs=offs, grouped=tuple(grouped), nodes=tuple(nodes), rows=tuple(row_inputs),
                                 exits=exits))
    return sorted(out, key=lambda s: order[s.nodes[0]])


def ep_axes(mesh) -> tuple[str, ...]:
    """The mesh axes expert parallelism runs over: the data-parallel and context-parallel
    ones (the axes that split the token rows between ranks holding the same weights)."""
    return tuple(a for a in ("dp", "cp") if a in mesh.axes and mesh.size(a) > 1)


def _strip(n):
    """``n`` under the re-layout steps and dtype casts on it (the value they re-lay out)."""
    while isinstance(n, fx.Node) and (_is_step(n) or n.target in (aten.to.dtype, aten._to_copy.default)):
        n = n.args[0]
    return n


def expert_param_rows(seg: ExpertSegment, v: fx.Node) -> fx.Node | None:
    """The per-expert parameter (``[E, ...]``, a ``get_attr``) whose rows the row input ``v``
    gathers by each row's expert id (``P[ids]``, ``ids`` the sorted expert ids that ``seg``'s
    offsets count: gpt-oss's gate_up bias), through re-layout steps; else None. Such a row
    is not moved: the experts' owner gathers it from its own block of ``P`` (the rows it
    receives are expert-major: :func:`~autoshard.runtime.experts.ep_expert_rows`), so ``P``
    is split over ep like the experts' weights."""
    n = _strip(v)
    if not (isinstance(n, fx.Node) and n.target is aten.index.Tensor and isinstance(n.args[0], fx.Node)
            and n.args[0].op == "get_attr" and len(n.args[1]) == 1 and isinstance(n.args[1][0], fx.Node)):
        return None
    w = n.args[0].meta.get("val")
    if not isinstance(w, torch.Tensor) or w.dim() < 1 or int(w.shape[0]) != seg.num_experts:
        return None
    counts = seg.offs.args[0] if seg.offs.target is aten.cumsum.default else None
    if counts is None or counts.target is not aten.histc.default or _strip(counts.args[0]) is not n.args[1][0]:
        return None
    return n.args[0]


def mode_layout(spec, mesh, ep: int):
    """A parameter's layout under the mode's own rules, from its layout in a plan with
    ``ep`` (:func:`plan_expert_parallel`): an expert weight's expert dim unsplit again. A
    graph planned with a module's layouts pinned (``generate()``'s step) pins these (an expert
    weight ``[E, ...]``, 3-D, or a per-expert bias gathered by expert id, 2-D), and
    its expert-parallel pass splits them as the module's were."""
    axes = ep_axes(mesh)
    if ep > 1 and axes and spec.ndim >= 2 and tuple(spec.dims[0]) == axes:
        return spec.with_dim(0, ())
    return spec


def _needs_grad(n: fx.Node, trainable: set[str], memo: dict) -> bool:
    """Whether a value depends on a trainable parameter (its gradient flows back)."""
    if n in memo:
        return memo[n]
    memo[n] = False
    if n.op == "get_attr":
        memo[n] = n.target in trainable
    else:
        memo[n] = any(_needs_grad(a, trainable, memo) for a in n.all_input_nodes)
    return memo[n]


def _row_bytes(plan, nodes: dict, seg: ExpertSegment, n: fx.Node) -> int:
    """A row's local bytes where ``seg`` takes ``n`` (or gives it out, an exit): its spec after
    the re-layout steps its first consumer in the segment puts on it (the rows move after them)."""
    from autoshard.ir.argpath import get_arg
    from autoshard.ir.spec import ShardSpec

    v = n.meta["val"]
    np_ = nodes.get(n.name)
    spec = np_.out_spec if np_ is not None and isinstance(np_.out_spec, ShardSpec) else None
    if spec is None:
        return math.prod(v.shape[1:]) * v.element_size() if n.op != "call_function" else \
            math.prod(np_.local_shape[1:]) * v.element_size()
    user = next((u for u in seg.nodes if n in u.all_input_nodes), None)     # None: an exit
    for path, steps in nodes[user.name].arg_steps if user is not None else ():
        if get_arg(user, path) is n:
            for st in steps:
                spec = st.effect(spec, tuple(v.shape), plan.mesh, v.element_size(), False)[1]
    local = [s // plan.mesh.size(d) if d else s for s, d in zip(v.shape, spec.dims)]
    return math.prod(local[1:]) * v.element_size()


def _split_experts(p, axes: tuple[str, ...], ep: int, size: int):
    """An expert weight's plan cut on its expert dim over ``axes`` (``size`` ranks) for ``ep``
    ranks, its gradient sync over ``axes`` dropped. Where ``ep`` does not divide the ``E``
    experts (``ep = size`` then: :func:`_check_uneven`), the expert dim is zero-padded to
    ``ep · ceil(E / ep)``: padded experts the router never picks, so they get no row, no
    gradient and stay zero (docs/design.md, "Expert parallelism"). Where ``copies = size / ep > 1``, each
    block of ``E / ep`` experts is held by ``copies`` consecutive ranks along ``axes``: the
    padded-copies layout of docs/design.md, "Uneven widths" (the ``ep`` blocks each repeated
    ``copies`` times, ``E · copies`` rows split ``size`` ways), whose gradients the copies'
    all-reduce sums (:meth:`~autoshard.ir.plan.ShardingPlan.copy_sync_comms`)."""
    from autoshard.ir.errors import ShardingError

    if p.spec.dims[0]:
        raise ShardingError(f"expert parallelism: the expert dim of `{p.name}` is already split over "
                            f"{p.spec.dims[0]}; valid here: ep=1")
    spec, sync, copies = p.spec.with_dim(0, axes), tuple(a for a in p.grad_sync if a not in axes), size // ep
    e = p.global_shape[0]
    if e % ep:
        return dataclasses.replace(p, spec=spec, grad_sync=sync, dense_shape=tuple(p.global_shape),
                                   global_shape=(-(-e // ep) * ep, *p.global_shape[1:]))
    if copies == 1:
        return dataclasses.replace(p, spec=spec, grad_sync=sync)
    if p.dense_shape:
        raise ShardingError(f"expert parallelism: `{p.name}` is padded already ({p.dense_shape} -> "
                            f"{p.global_shape}); valid here: ep={size} or ep=1")
    return dataclasses.replace(p, spec=spec, grad_sync=sync, global_shape=(p.global_shape[0] * copies,
                               *p.global_shape[1:]), dense_shape=tuple(p.global_shape), pad_segments=ep,
                               pad_copies=copies)


def _check_uneven(seg: ExpertSegment, ep: int, size: int, params: dict) -> None:
    """Refuse an ``ep`` that does not divide ``seg``'s experts where zero-padding them is not
    implemented: below the ep ranks' number (the blocks held in copies, :func:`_split_experts`)
    or on a weight padded already (an uneven width under tp); the message names the valid ep."""
    from autoshard.ir.errors import ConfigError

    e = seg.num_experts
    if not e % ep:
        return
    padded = [w for w in seg.weights if w in params and params[w].dense_shape]
    if ep == size and not padded:
        return
    why = (f"their weight `{padded[0]}` is padded already (an uneven width under tp)" if padded else
           f"ep={ep} is below the {size} data-parallel (× context-parallel) ranks (blocks held in copies)")
    valid = [d for d in range(1, size + 1) if size % d == 0 and (e % d == 0 or (d == size and not padded))]
    raise ConfigError(f"ep={ep} does not divide the {e} experts of `{seg.grouped[0].name}` and they cannot be "
                      f"zero-padded: {why}; valid ep: {valid} (expert-TP, ep=1, takes any expert count)")


def plan_expert_parallel(plan, gm: fx.GraphModule, ep: int):
    """``plan`` with its experts cut over ``ep`` ranks of :func:`ep_axes` (``ep`` divides
    their size; :func:`_split_experts`): each expert weight split on its expert dim (a rank holds
    ``E / ep`` experts, each as the TP layout keeps it), its gradient no longer summed over
    those axes (the rows of every rank of the ep group reach the experts' owner: its
    gradient is already their sum; the copies' all-reduce adds the other groups'), and the
    all-to-alls on the nodes that run them, at their expected bytes under uniform routing
    (a row leaves its rank with probability ``(ep-1)/ep``).

    Raises:
        ConfigError: ``ep`` does not divide the plan's data-parallel (× context-parallel)
            ranks, the model has no grouped expert matmul, or ``ep`` does not divide the
            experts where they cannot be zero-padded (:func:`_check_uneven`); the message
            names the valid choices.
        ShardingError: an expert segment's rows are not split over those axes.
    """
    from autoshard.ir.errors import ConfigError, ShardingError
    from autoshard.ir.plan import Comm

    axes = ep_axes(plan.mesh)
    size = plan.mesh.size(axes) if axes else 1
    if size % ep:
        raise ConfigError(f"ep={ep}: expert parallelism runs over the data-parallel (× context-parallel) ranks, "
                          f"{size} here ({plan.mesh}); valid ep: {[d for d in range(1, size + 1) if size % d == 0]}")
    segs = expert_segments(gm)
    if not segs:
        raise ConfigError(f"ep={ep}: the model has no grouped expert matmul (a mixture-of-experts layer) to "
                          f"spread over ranks; valid ep: 1")
    orig, nodes = {p.name: p for p in plan.params}, {n.name: n for n in plan.nodes}
    params = dict(orig)
    trainable = {p.name for p in plan.params if p.trainable and not p.is_buffer}
    memo: dict = {}
    for seg in segs:
        e = seg.num_experts
        _check_uneven(seg, ep, size, orig)
        local = -(-e // ep)         # experts per rank; the last zero-padded where ep does not divide e
        first = nodes[seg.grouped[0].name]
        if tuple(first.out_spec.dims[0]) != axes:
            raise ShardingError(f"expert parallelism over {axes}: the token rows of `{first.name}` are split over "
                                f"{first.out_spec.dims[0]}, not over the ep ranks; valid here: ep=1",
                                node=seg.grouped[0])
        rows = first.local_shape[0]

        def a2a(phase, v):
            return Comm(phase=phase, kind="all_to_all", axes=axes, group_size=ep,
                        buffer_bytes=int(round(rows * (ep - 1) / ep * _row_bytes(plan, nodes, seg, v))))

        def both(v):
            return [a2a("fwd", v)] + ([a2a("bwd", v)] if _needs_grad(v, trainable, memo) else [])

        counts = Comm(phase="fwd", kind="all_to_all", axes=axes, group_size=ep, buffer_bytes=(ep - 1) * local * 8)
        gathered = {v: expert_param_rows(seg, v) for v in seg.rows[1:]}
        moved = [v for v in seg.rows if gathered.get(v) is None]
        out = [counts] + [a2a("fwd", v) for v in moved] + [a2a("bwd", v) for v in moved
                                                          if _needs_grad(v, trainable, memo)]
        nodes[first.name] = dataclasses.replace(first, comms=first.comms + tuple(out), notes=first.notes + (
            f"expert parallelism: {local} of {e} experts per rank" + (f" (zero-padded to {local * ep})" if e % ep else "")
            + "; token rows dispatched to them by all-to-all "
            f"over {','.join(axes)}" + (f" (groups of {ep})" if ep < size else ""),))
        for x in seg.exits:
            nodes[x.name] = dataclasses.replace(nodes[x.name], comms=nodes[x.name].comms + tuple(both(x)))
        for g in seg.grouped:
            nodes[g.name] = dataclasses.replace(nodes[g.name], weight=f"{nodes[g.name].weight} · experts / {ep}",
                                                param_bytes=nodes[g.name].param_bytes * local // e)
        for name in seg.weights + tuple(w.target for w in gathered.values() if w is not None):
            params[name] = _split_experts(orig[name], axes, ep, size)
    return dataclasses.replace(plan, nodes=tuple(nodes[n.name] for n in plan.nodes),
                               params=tuple(params[p.name] for p in plan.params))


def dispatch_experts(gm: fx.GraphModule, plan, groups: dict[str, str]) -> None:
    """Run the expert segments of a rank's rewritten module whose weights ``plan`` splits
    on the expert dim on the ranks owning their experts, in place: the counts exchanged
    (:func:`~autoshard.runtime.experts.ep_route`, once per layer), each row-aligned input
    dispatched (:func:`~autoshard.runtime.experts.ep_dispatch`), the grouped matmuls on the
    local group offsets, and each value leaving the segment combined back
    (:func:`~autoshard.runtime.experts.ep_combine`)."""
    import torch.distributed as dist

    from autoshard.runtime import experts as X
    from autoshard.runtime import selfcheck
    from autoshard.runtime.groups import axes_label, stride_group

    params = plan.params_by_name()
    split = {n.args[1].target for n in gm.graph.nodes if n.target is grouped_linear and
             isinstance(n.args[1], fx.Node) and n.args[1].target in params and ep_axes(plan.mesh) and
             tuple(params[n.args[1].target].spec.dims[0]) == ep_axes(plan.mesh)}
    if not split:           # no expert parallelism in this plan: the graph as the mode rewrote it
        return
    g = gm.graph
    changed = False
    for seg in expert_segments(gm):
        axes = {tuple(params[w].spec.dims[0]) for w in seg.weights if w in params}
        if axes == {()} or not axes:
            continue
        if len(axes) != 1:
            raise ValueError(f"the experts of `{seg.grouped[0].name}` are split over different axes: {axes}")
        axes = axes.pop()
        copies = max(params[w].pad_copies for w in seg.weights)     # > 1: ep < size(axes), see _split_experts
        group = groups[axes_label(axes)] if copies <= 1 else stride_group(plan.mesh, axes, copies, dist.get_rank())
        inside = set(seg.nodes)
        with g.inserting_before(seg.nodes[0]):
            route = g.call_function(X.ep_route, (seg.offs, group))
            local_offs = g.call_function(X.ep_local_offs, (route,))
        for v in seg.rows:
            users = [n for n in seg.nodes if v in n.all_input_nodes]
            with g.inserting_before(users[0]):
                w = expert_param_rows(seg, v)
                moved = g.call_function(X.ep_dispatch, (v, route)) if w is None else _local_rows(g, v, w, route)
            for n in users:
                n.replace_input_with(v, moved)
            _erase_unused(g, v)
        for n in seg.grouped:
            n.replace_input_with(seg.offs, local_offs)
        for n in seg.nodes:      # their rows are the received ones now: no promise of the planned count
            n.meta.pop(selfcheck.META, None)
        for x in seg.exits:
            users = [u for u in x.users if u not in inside]
            with g.inserting_after(x):
                back = g.call_function(X.ep_combine, (x, route))
            back.meta = dict(x.meta)
            for u in users:
                u.replace_input_with(x, back)
        changed = True
    if changed:
        g.lint()
        gm.recompile()


def _local_rows(g: fx.Graph, v: fx.Node, w: fx.Node, route: fx.Node) -> fx.Node:
    """In place of the row input ``v`` (``w[ids]`` and the re-layout steps on it): the rows of
    this rank's block of ``w`` for the rows it received (:func:`~autoshard.runtime.experts.ep_expert_rows`),
    the same steps applied (they act on the feature dims: the rows are not re-laid out in a
    segment, :func:`expert_segments`)."""
    from autoshard.runtime import experts as X

    chain = []
    n = v
    while n.op != "call_function" or n.target is not aten.index.Tensor:
        chain.append(n)
        n = n.args[0]
    out = g.call_function(X.ep_expert_rows, (w, route))
    for st in reversed(chain):
        out = g.call_function(st.target, (out, *st.args[1:]), dict(st.kwargs))
    return out


def _erase_unused(g: fx.Graph, v: fx.Node) -> None:
    """Erase ``v`` and what only it used, up to the parameter, once nothing reads it (a gather
    by global expert ids would index past the rank's block)."""
    while isinstance(v, fx.Node) and v.op == "call_function" and not v.users:
        args = v.all_input_nodes
        g.erase_node(v)
        v = args[0] if args and args[0].op == "call_function" else None
