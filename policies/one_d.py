"""1D tensor parallelism (Megatron): column / row pairs found from the graph.

A Linear whose input is replicated and whose output flows (through pointwise,
view and attention ops) into another Linear, the loss or the graph output is
column-parallel; a Linear whose input arrives split on its features is
row-parallel and all-reduces its output. The largest embedding table is
vocab-parallel; a weight tied to it keeps its vocab split (the LM head is then
column-parallel and the loss vocab-parallel). The layout and its collectives are
drawn in docs/design.md, "1d".

>>> from autoshard.policies import make_policy
>>> p = make_policy("1d", 4)
>>> p.mesh, p.dim_splits()[1]
(Mesh(axes=('tp',), sizes=(4,)), 'tp=4')
"""

from __future__ import annotations

import torch

from autoshard.ir.argpath import get_arg
from autoshard.ir.errors import ConfigError
from autoshard.ir.grouped import grouped_linear
from autoshard.ir.kernels import RowLinear, VocabEmbedding
from autoshard.ir.mesh import Mesh
from autoshard.ir.spec import ShardSpec

from .base import Choice, Policy, RuleContext
from .ops.matmul import grouped_offs_spec, linear_operands

__all__ = ["OneD"]

aten = torch.ops.aten
_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.alias.default, aten.clone.default,
          aten.contiguous.default}


class OneD(Policy):
    """1D (Megatron) tensor parallelism on a mesh ``tp[p]`` (``dp[r] × tp[p]`` with replicas).

    Heads, the intermediate size and the vocabulary are split ``p`` ways; the hidden
    size stays whole, so norms and the residual stream are replicated.

    >>> p = OneD(OneD.make_mesh(8, dp=2))
    >>> p.mesh, p.label(p.mesh)
    (Mesh(axes=('dp', 'tp'), sizes=(2, 4)), '1d [4] × dp2')
    >>> p.dim_splits()[0]["intermediate_size"], p.batch_split()
    (4, (1, ''))
    """

    name = "1d"
    order = 0
    tp_axes = ("tp",)
    batch_axes = ()
    size_unit = "tp sizes"
    #: a row-split Linear and the low-rank pair beside it (LoRA's A, B on the same input)
    #: leave partial sums, reduced once after their add (1d-sp reduce-scatters each instead)
    fuse_low_rank = True

    @classmethod
    def make_mesh(cls, world_size: int, *, depth: int | None = None, dp: int = 1) -> Mesh:
        """``tp[world_size / dp]``, with a ``dp`` axis in front when ``dp > 1``.

        Raises:
            ConfigError: a ``depth`` other than 1, or a ``dp`` that does not divide the world size; the message lists the valid choices.
        """
        if depth not in (None, 1):
            raise ConfigError(f"1d takes no depth (got depth={depth}); depth belongs to mode='2.5d'")
        tp = cls._check_dp(world_size, dp)
        if dp > 1:
            return Mesh(axes=("dp", "tp"), sizes=(dp, tp))
        return Mesh(axes=("tp",), sizes=(tp,))

    def dim_splits(self) -> tuple[dict[str, int], str]:
        """Heads, kv heads, intermediate size and vocabulary split ``tp`` ways; hidden whole."""
        p = self.mesh.size("tp")
        return {"num_attention_heads": p, "num_key_value_heads": p, "intermediate_size": p,
                "vocab_size": p}, f"tp={p}"

    def width_multiple(self) -> int:
        """The tp size: heads and intermediate widths split over tp are padded to it."""
        return self.mesh.size("tp")

    @classmethod
    def valid_world_sizes(cls, n: int, limit: int = 4096) -> list[int]:
        """Every divisor of ``n`` up to ``limit``.

        >>> OneD.valid_world_sizes(12)
        [1, 2, 3, 4, 6, 12]
        """
        return [p for p in range(1, min(n, limit) + 1) if n % p == 0]

    # ------------------------------------------------------------------ linear
    def linear(self, ctx: RuleContext) -> Choice:
        """Row-parallel (:class:`~autoshard.ir.kernels.RowLinear`, all-reduce of the output)
        when the input arrives split on its features; column-parallel (no forward
        collective) when the output feeds a parallel consumer and divides; replicated
        otherwise, or when a tied table already fixed the weight's split."""
        node = ctx.node
        return self._linear(ctx, ctx.spec(get_arg(node, linear_operands(node)[0])))

    def _linear(self, ctx: RuleContext, sx: ShardSpec) -> Choice:
        """The 1D choice for a Linear whose input arrives (or is to be re-laid out) as ``sx``."""
        node = ctx.node
        xp, wp, bp, nd, kd = linear_operands(node)
        x, w = get_arg(node, xp), get_arg(node, wp)
        tp = self.tp_axes
        role = _fused_role(ctx, node) if self.fuse_low_rank and self.mesh.size(tp) > 1 else None
        if role == "up" and tuple(sx.partial) == tp and not bp and sx.dims[-1] != tp:
            # the up half of a low-rank pair on a partial input: linear in it, the sum waits for the add
            d = [()] * len(ctx.pshape(w))
            out = ShardSpec(dims=sx.dims[:-1] + ((),), segments=sx.segments[:-1] + (1,), partial=tp)
            return Choice(out=out, inputs={xp: sx, wp: ShardSpec(dims=tuple(d))}, weight="replicated",
                          notes=("partial sum, reduced once with the Linear it is added to",))
        sx = sx.with_partial(())
        wshape = ctx.pshape(w)
        n, k = wshape[nd], wshape[kd]
        tp = self.tp_axes
        c = self.mesh.size(tp)
        fixed = ctx.fixed_param_spec(w)
        rows = sx.dims[:-1]
        rseg = sx.segments[:-1]

        def wspec(n_axes=(), k_axes=(), m=1, widths=()):
            d = [()] * len(wshape)          # a per-expert weight [E, n, k] keeps E whole
            sg = [1] * len(wshape)
            d[nd], d[kd] = n_axes, k_axes
            sg[nd] = m if n_axes else 1
            wd = [()] * len(wshape)
            wd[nd] = widths if n_axes else ()
            return ShardSpec(dims=tuple(d), segments=tuple(sg), widths=tuple(wd))

        def local(note=""):
            req = ShardSpec(dims=rows + ((),), segments=rseg + (1,))
            ins = {xp: req, wp: wspec()}
            if node.target is grouped_linear:
                ins[(2,)] = grouped_offs_spec(self.mesh, rows[0] if rows else ())
            if bp:
                ins[bp] = ShardSpec(dims=((),))
            return Choice(out=req, inputs=ins, weight="replicated", notes=(note,) if note else ())

        if c == 1:
            return local()
        if ctx.forced_replicate(node):
            return local("whole: " + (ctx.forced_reason(node) or "its out-feature split could not pass a later op"))
        if fixed is not None:
            if fixed.dims[nd] == tp:
                wd = fixed.block_widths(nd) if fixed.widths else ()
                return self._column(ctx, xp, wp, bp, rows, rseg, wspec(tp, (), fixed.segments[nd], wd),
                                    fixed.segments[nd], wd)
            if fixed.dims[kd] == tp and sx.dims[-1] == tp:
                return self._row(ctx, xp, wp, bp, sx, wspec((), tp))
            if fixed.is_replicated:
                return local(f"whole: its weight `{w.target}` is held whole by an earlier use (a shared weight)")
        if sx.dims[-1] == tp and k % c == 0:
            if role in ("base", "down"):
                # a row-split Linear with a low-rank pair beside it: both sums wait for their add
                out = ShardSpec(dims=sx.dims[:-1] + ((),), segments=sx.segments[:-1] + (1,), partial=tp)
                ins = {xp: sx, wp: wspec((), tp)}
                return Choice(out=out, inputs=ins, weight=f"row: in features / {c}",
                              notes=("partial sum, reduced once after the add with its low-rank pair",))
            return self._row(ctx, xp, wp, bp, sx, wspec((), tp))
        m = ctx.output_segments(node)
        # fused blocks of unequal widths (Phi-3's q, k, v with fewer kv heads): split per block
        wd = ctx.output_block_widths(node) if m == 1 else ()
        stop = ctx.split_stop(node, unequal=True)
        up = _low_rank_up(ctx, node, n, k)
        if up is not None:      # the down half of a low-rank pair (LoRA's A): its up half splits instead
            return local(f"whole: the down half of a low-rank pair ({k} -> {n} -> {up} features, into "
                         f"`{_up_of(node).name}`): held whole, its consumer splits its out features "
                         f"with no collective, where splitting this one would all-reduce the consumer's output")
        if wd and not stop and all(x % c == 0 for x in wd):
            return self._column(ctx, xp, wp, bp, rows, rseg, wspec(tp, (), len(wd), wd), len(wd), wd)
        if not wd and not stop and n % (c * m) == 0:
            return self._column(ctx, xp, wp, bp, rows, rseg, wspec(tp, (), m), m)
        return local(_whole_note(stop, n, k, f" in fused blocks of widths {wd}" if wd else
                                 f" × {m} fused blocks" if m > 1 else "", c, in_split=sx.dims[-1] == tp))

    def _column(self, ctx, xp, wp, bp, rows, rseg, ws, m, widths=()):
        tp = self.tp_axes
        req = ShardSpec(dims=rows + ((),), segments=rseg + (1,))
        ins = {xp: req, wp: ws}
        if ctx.node.target is grouped_linear:
            ins[(2,)] = grouped_offs_spec(self.mesh, rows[0] if rows else ())
        if bp:
            ins[bp] = ShardSpec(dims=(tp,), segments=(m,), widths=(widths,))
        wd = ((),) * len(rows) + (widths,)
        out = ShardSpec(dims=rows + (tp,), segments=rseg + (m,), widths=wd)
        return Choice(out=out, inputs=ins, weight=f"column: out features / {self.mesh.size(tp)}"
                      + (f" (fused blocks of widths {widths})" if widths else f" ({m} fused blocks)" if m > 1 else ""))

    def _row(self, ctx, xp, wp, bp, sx, ws):
        tp = self.tp_axes
        ins = [(xp, sx), (wp, ws)]
        if bp:
            ins.append((bp, ShardSpec(dims=((),))))
        out = ShardSpec(dims=sx.dims[:-1] + ((),), segments=sx.segments[:-1] + (1,))
        nd = linear_operands(ctx.node)[3]
        if ctx.node.target is grouped_linear:
            # per expert, the local product is a partial sum over tp: it stays partial
            # through the ops linear in it (routing weights, the un-permuting gather,
            # the top-k sum) and is all-reduced where a consumer needs it whole
            ins.append(((2,), grouped_offs_spec(self.mesh, sx.dims[0] if sx.ndim > 1 else ())))
            return Choice(out=out.with_partial(tp), inputs=dict(ins),
                          weight=f"row: in features / {self.mesh.size(tp)} per expert",
                          notes=("partial sum, reduced where a consumer needs it whole",))
        return Choice.run(RowLinear(axes=tp, x=xp, w=wp, b=bp, n_dim=nd, in_specs=tuple(ins), out_spec=out),
                          weight=f"row: in features / {self.mesh.size(tp)}")

    # --------------------------------------------------------------- embedding
    def embedding(self, ctx: RuleContext) -> Choice:
        """Vocab-parallel (:class:`~autoshard.ir.kernels.VocabEmbedding`) for the largest
        table, for a table tied to a vocab-split one, and for a lookup added to another
        split lookup (both left partial, reduced once after the add); replicated otherwise."""
        node = ctx.node
        w, ids = node.args[0], node.args[1]
        si = ctx.spec(ids)
        V, h = ctx.pshape(w)
        tp = self.tp_axes
        c = self.mesh.size(tp)
        fixed = ctx.fixed_param_spec(w)
        # the largest table is split (a vocabulary is padded to divide); a lookup added to
        # another split lookup (token + position) is split too, at no cost: both stay
        # partial sums and are reduced once, after the add
        summed = _summed_with_split_lookup(ctx, c)
        vocab = (fixed is not None and fixed.dims[0] == tp) or (
            fixed is None and c > 1 and V % c == 0 and (ctx.is_largest_embedding(w) or summed))
        out = ShardSpec(dims=si.dims + ((),))
        if vocab:
            ins = (((0,), ShardSpec(dims=(tp, ()))), ((1,), si))
            if summed:
                k = VocabEmbedding(axes=tp, reduce=False, in_specs=ins, out_spec=out.with_partial(tp))
                return Choice.run(k, weight=f"rows / {c}", notes=("partial sum, reduced after the add",))
            return Choice.run(VocabEmbedding(axes=tp, in_specs=ins, out_spec=out), weight=f"vocab / {c}")
        if c == 1:
            why = ""
        elif fixed is not None:
            why = f"whole: its table `{w.target}` is held whole by an earlier use (a shared weight)"
        elif V % c:
            why = f"whole: {V} rows do not divide tp {c}"
        else:
            why = ("whole: 1d splits the largest table and tables summed with a split lookup; this one is "
                   "smaller and its lookup is not summed with one")
        return Choice(out=out, inputs={(0,): ShardSpec(dims=((), ())), (1,): si}, weight="replicated",
                      notes=(why,) if why else ())


_VIEWS = _CASTS | {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_LINEARS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default}


def _linear_after(node):
    """The Linear that alone consumes ``node``'s output as its input, through views and
    casts, or None."""
    u, cur = _walk_users(node, _VIEWS)
    if u is None or u.op != "call_function" or u.target not in _LINEARS or get_arg(u, linear_operands(u)[0]) is not cur:
        return None
    return u


_NORMS = {aten.mean.dim, aten.sum.dim_IntList, aten.layer_norm.default} | \
    ({aten.rms_norm.default} if hasattr(aten, "rms_norm") else set())


def _linear_through_norm(node, limit: int = 32):
    """The one Linear that every path from ``node``'s output reaches, as its input, through
    a norm (a norm op, or an inline RMSNorm: elementwise ops, casts, views and per-token
    statistics) between a low-rank pair: DeepSeek-V3's ``q_b_proj(q_a_layernorm(q_a_proj(x)))``;
    the other operands on the way are parameters, constants or sizes. None where a path
    ends elsewhere, another activation joins in, no norm is on the way, or there is no
    such Linear."""
    chain, todo, ups = {node}, [node], set()
    while todo:
        cur = todo.pop()
        for u in cur.users:
            if u.target in (aten._assert_tensor_metadata.default, aten.sym_size.int):
                continue
            if u.op != "call_function":
                return None
            if u.target in _LINEARS and get_arg(u, linear_operands(u)[0]) is cur and _weight_is_param(u):
                ups.add(u)
                continue
            t = u.target
            through = t in _VIEWS or t in _NORMS or (
                isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags)
            if not through:
                return None
            if u not in chain:
                chain.add(u)
                todo.append(u)
            if len(chain) > limit:
                return None
    if not any(u.target in _NORMS for u in chain):
        return None         # no norm between: a narrow MLP (fc1 -> gelu -> fc2) is a column / row pair
    if any(a not in chain and _is_activation(a) for u in chain - {node} for a in u.all_input_nodes):
        return None
    return next(iter(ups)) if len(ups) == 1 else None


def _up_of(node):
    """The up half of a low-rank pair whose down half is ``node``: the Linear consuming its
    output directly or through a norm; None when there is none."""
    return _linear_after(node) or _linear_through_norm(node)


def _weight_is_param(n) -> bool:
    return getattr(get_arg(n, linear_operands(n)[1]), "op", None) == "get_attr"


def _is_activation(a) -> bool:
    """A tensor computed in the graph (not a parameter or constant, not a size)."""
    v = a.meta.get("val")
    return a.op != "get_attr" and isinstance(v, torch.Tensor) and v.ndim > 0


def _low_rank_up(ctx: RuleContext, node, n: int, k: int) -> int | None:
    """The out features of the Linear that alone consumes ``node``'s output when the pair
    is low-rank (``node`` narrows ``k`` features to ``n``, its consumer widens them again:
    LoRA's A then B; a norm between them as DeepSeek-V3's ``q_a_proj`` and ``q_b_proj``
    have, :func:`_linear_through_norm`); None otherwise. Splitting the narrow ``n`` would
    make the consumer row-parallel, an all-reduce of its wide output; holding the narrow
    half whole costs ``n × k`` replicated weights and lets the wide half split its output
    instead."""
    up = _up_of(node) if n < k else None
    if up is None or not n < k:
        return None
    _, wp, _, nd, _ = linear_operands(up)
    w = get_arg(up, wp)
    if getattr(w, "op", None) != "get_attr":
        return None
    wide = ctx.pshape(w)[nd]
    return wide if n < wide else None


_THROUGH = _VIEWS | {aten.dropout.default}


def _back(node):
    """``node`` followed back through views, casts and dropout."""
    while getattr(node, "target", None) in _THROUGH:
        node = node.args[0]
    return node


def _fused_role(ctx: RuleContext, node) -> str | None:
    """The role of the Linear ``node`` in ``base(x) + up(down(x)) * s`` (a Linear and a
    low-rank pair on the same input, added: LoRA), or None: ``"base"``, ``"down"`` or
    ``"up"``. Found from the graph: the add, the scale, the pair's widths."""
    scaled = _VIEWS | {aten.mul.Tensor, aten.mul.Scalar}
    up = _linear_after(node)
    add = _walk_users(up, scaled)[0] if up is not None else None       # down -> up -> add
    direct = _walk_users(node, scaled)[0]
    for a in (add, direct):
        if a is None or a.target != aten.add.Tensor or len(a.args) != 2:
            continue
        sides = [_back_through(x, {aten.mul.Tensor, aten.mul.Scalar}) for x in a.args]
        for base, up in (sides, sides[::-1]):
            if not (_is_linear(base) and _is_linear(up)) or linear_operands(base)[2] is not None:
                continue        # a biased base would add its bias once per rank to a partial sum
            down = _back(get_arg(up, linear_operands(up)[0]))
            if not _is_linear(down) or _linear_after(down) is not up:
                continue
            x_base, x_down = (_back(get_arg(n, linear_operands(n)[0])) for n in (base, down))
            if x_base is not x_down:
                continue
            n_down, k_down = _out_in(ctx, down)
            if _low_rank_up(ctx, down, n_down, k_down) is None:
                continue
            return {base: "base", down: "down", up: "up"}.get(node)
    return None


def _is_linear(n) -> bool:
    return getattr(n, "op", None) == "call_function" and n.target in _LINEARS and \
        getattr(get_arg(n, linear_operands(n)[1]), "op", None) == "get_attr"


def _out_in(ctx: RuleContext, node) -> tuple[int, int]:
    _, wp, _, nd, kd = linear_operands(node)
    shape = ctx.pshape(get_arg(node, wp))
    return shape[nd], shape[kd]


def _walk_users(node, through):
    """``(the one user of node past ops in through, the last value before it)``, following
    single users (shape asserts and size reads aside); ``(None, None)`` where a value has
    several users or none."""
    cur = node
    while True:
        users = [u for u in cur.users if u.target not in (aten._assert_tensor_metadata.default, aten.sym_size.int)]
        if len(users) != 1:
            return None, None
        if users[0].target not in through:
            return users[0], cur
        cur = users[0]


def _back_through(node, scales):
    """``node`` followed back through views, casts and multiplications by a scale (a
    number or a tensor that is not a Linear's output chain)."""
    while True:
        node = _back(node)
        if getattr(node, "target", None) in scales:
            tensors = [a for a in node.args if hasattr(a, "op")]
            node = tensors[0] if tensors else node
            if tensors:
                continue
        return node


def _whole_note(stop: str, n: int, k: int, blocks: str, c: int, *, in_split: bool) -> str:
    """The note of a Linear 1d holds whole: why neither its out features (column) nor
    its in features (row) split over tp (size ``c``)."""
    why = [f"its input arrives split on {k} in features, which do not divide tp {c}" if in_split
           else "its input arrives with whole in features (no row split)"]
    if stop:
        why.append(f"the split of its out features could not pass {stop}")
    else:
        why.append(f"{n} out features do not divide tp {c}{blocks}")
    return "whole: " + "; ".join(why)


def _summed_with_split_lookup(ctx: RuleContext, c: int) -> bool:
    """Whether the lookup's only use is an add with another lookup whose table's
    rows divide ``c`` (and is not already held whole)."""
    node = ctx.node
    while True:                 # through dtype casts (GPT-2 casts its position lookup)
        users = [u for u in node.users if u.target != aten._assert_tensor_metadata.default]
        if len(users) != 1 or users[0].target not in _CASTS:
            break
        node = users[0]
    if len(users) != 1 or users[0].target != aten.add.Tensor or len(users[0].args) != 2:
        return False
    other = next((a for a in users[0].args if a is not node), None)
    while getattr(other, "target", None) in _CASTS:
        other = other.args[0]
    if other is None or getattr(other, "target", None) != aten.embedding.default:
        return False
    table = other.args[0]
    fixed = ctx.fixed_param_spec(table)
    return getattr(table, "op", None) == "get_attr" and ctx.pshape(table)[0] % c == 0 and (
        fixed is None or bool(fixed.dims[0]))
