"""Give every graph value a ShardSpec and produce the :class:`ShardingPlan`.

Walks the captured graph in order. Heavy ops (linear, embedding) go to the
mode's policy; everything else to the shared rules in
:mod:`autoshard.policies.generic`. Where a rule needs an input in another
layout the pass records the re-layout steps (gather / scatter / reduce ...).

Gradient bookkeeping follows one invariant: *a replicated value's gradient is
complete and identical on every rank*. So where an op consumes a value that is
replicated on mesh axis ``a`` while its output is split or partial on ``a``, the
value's gradient from that op is partial on ``a``: the pass inserts
``copy_to(a)`` (identity forward, all-reduce backward) on that edge, or, for a
parameter consumed directly, adds ``a`` to the parameter's after-backward
gradient all-reduce (one all-reduce per parameter, however many uses).

Runs with no process group, on meta weights, for any world size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
from dataclasses import dataclass

import torch
from torch import fx

from autoshard.ir.argpath import get_arg
from autoshard.ir.errors import ShardingError
from autoshard.ir.kernels import KernelIO, check_dropout_mode
from autoshard.ir.mesh import Mesh
from autoshard.ir.plan import Comm, NodePlan, ParamPlan, ShardingPlan, Step
from autoshard.policies.base import Choice, NeedReplicate, Policy, SymbolicSizes
from autoshard.policies.generic import rule_for, writes_first_arg
from autoshard.policies.linear_ops import linear_operands
from autoshard.ir.spec import ShardSpec, replicated

from .annotate import Annotation, annotate, param_names
from .row_order import CONFLICT, LOCAL_ROWS_NOTE, RowFact, row_facts

__all__ = ["propagate", "remember_row_facts", "state_inputs"]

aten = torch.ops.aten
_PRIME_BATCH = SymbolicSizes.BATCH
_PRIME_SEQ = SymbolicSizes.SEQ
_get = get_arg


def _is_tensor_val(v) -> bool:
    return isinstance(v, torch.Tensor)


def state_inputs(gm: fx.GraphModule) -> tuple[str, ...]:
    """Graph inputs written in place before anything reads them: every use writes
    into the input as its first argument (the static KV cache a prefill or decode
    step updates with ``index_copy_``). Their layout is not the caller's: the first
    write gives it (:func:`autoshard.policies.generic.index_copy`) and the caller
    passes each rank's block, as :mod:`autoshard.generate` allocates it."""
    out = []
    for n in gm.graph.nodes:
        uses = [u for u in n.users if u.op == "call_function"      # not export's _guards_fn
                and u.target is not aten.sym_size.int]                  # a size read is no read
        if n.op != "placeholder" or not _is_tensor_val(n.meta.get("val")) or not uses:
            continue
        if all(writes_first_arg(u.target) and u.args and u.args[0] is n for u in uses):
            out.append(n.name)
    return tuple(out)


class _Shapes:
    """Global shapes of graph values, as exact probe integers (each free symbol a
    distinct large prime, so products match only when they truly match) and as
    concrete integers for the plan's batch size and sequence length."""

    def __init__(self, bsym, ssym, batch_size, seq_len):
        self.probe_map, self.conc_map = {}, {}
        if bsym is not None:
            self.probe_map[bsym] = _PRIME_BATCH
            self.conc_map[bsym] = batch_size
        if ssym is not None:
            self.probe_map[ssym] = _PRIME_SEQ
            self.conc_map[ssym] = seq_len
        self._extra = SymbolicSizes.others()
        self._seen: dict = {}      # id(SymNode) -> (node, probe, concrete): a size is evaluated once

    def _ev(self, s, mp, probe: bool):
        if isinstance(s, int):
            return s
        if isinstance(s, torch.SymInt):
            hit = self._seen.get(id(s.node))
            if hit is None:
                expr = s.node.expr
                for f in expr.free_symbols:
                    if f not in self.probe_map:
                        self.probe_map[f] = next(self._extra)
                        hint = s.node.hint if isinstance(s.node.hint, int) else 8
                        self.conc_map[f] = hint
                hit = self._seen[id(s.node)] = (s.node, int(expr.xreplace(self.probe_map)),
                                                int(expr.xreplace(self.conc_map)))
            return hit[1] if probe else hit[2]
        return int(s)

    def probe(self, shape) -> tuple[int, ...]:
        return tuple(self._ev(s, None, True) for s in shape)

    def concrete(self, shape) -> tuple[int, ...]:
        return tuple(self._ev(s, None, False) for s in shape)


@dataclass
class _State:
    specs: dict            # node name -> spec | tuple | None
    param_spec: dict       # get_attr target -> ShardSpec (fixed)
    param_sync: dict       # get_attr target -> set(axes)
    batch_index: set
    origin: dict           # node name -> linear node name whose column split it carries
    relayouts: set         # (value name, steps): re-layouts already made (the rewrite shares them)
    param_uses: dict       # get_attr target -> [(node name, arg path, axes its grad is partial on)]
    cp_pending: set = dataclasses.field(default_factory=set)   # partial lookups the cp split waits behind


class _Ctx:
    """What a rule may see of the graph: implements
    :class:`~autoshard.policies.base.RuleContext` for the node being visited."""

    def __init__(self, engine: "_Engine", node: fx.Node):
        self.e, self.node = engine, node
        self.mesh = engine.mesh
        self.batch_axes = engine.batch_axes
        self.BATCH = _PRIME_BATCH
        self.training = engine.training
        self.dropout = engine.dropout
        self.cp_attention = engine.policy.cp_attention
        self.cp_order = engine.policy.cp_order

    def is_tensor(self, a) -> bool:
        return isinstance(a, fx.Node) and _is_tensor_val(a.meta.get("val"))

    def spec(self, a):
        if not isinstance(a, fx.Node):
            return None
        if a.op == "get_attr" and a.target in self.e.params:
            return self.e.st.param_spec.get(a.target) or replicated(a.meta["val"].dim())
        if self.is_free_state(a):
            return replicated(a.meta["val"].dim())
        return self.e.st.specs.get(a.name)

    def is_free_param(self, a) -> bool:
        return isinstance(a, fx.Node) and a.op == "get_attr" and a.target in self.e.params \
            and a.target not in self.e.st.param_spec

    def is_free_state(self, a) -> bool:
        return isinstance(a, fx.Node) and a.op == "placeholder" and a.name in self.e.state \
            and a.name not in self.e.st.specs

    def fixed_param_spec(self, a):
        return self.e.st.param_spec.get(a.target) if isinstance(a, fx.Node) and a.op == "get_attr" else None

    def pshape(self, a) -> tuple[int, ...]:
        return self.e.shapes.probe(a.meta["val"].shape)

    def pshape_of_val(self, v) -> tuple[int, ...]:
        return self.e.shapes.probe(v.shape)

    def local_numel(self, a, spec: ShardSpec) -> int:
        shape = self.e.shapes.concrete(a.meta["val"].shape)
        return math.prod(spec.local_shape(shape, self.mesh))

    def local_size(self, a, spec: ShardSpec, d: int) -> int:
        shape = self.e.shapes.concrete(a.meta["val"].shape)
        return spec.local_shape(shape, self.mesh)[d]

    def is_batch_index(self, a) -> bool:
        return isinstance(a, fx.Node) and a.name in self.e.st.batch_index

    def row_fact(self, a, i: int | None = None) -> RowFact:
        f = self.e.rows.get(a.name, RowFact()) if isinstance(a, fx.Node) else RowFact()
        if isinstance(f, tuple):
            return f[i] if i is not None else RowFact()
        return f

    def forced_replicate(self, node) -> bool:
        return node.name in self.e.forced

    def forced_reason(self, node) -> str:
        """Why a re-plan holds this Linear whole: the op that refused its output's split
        (empty when it is not forced)."""
        return self.e.forced_why.get(node.name, "") if node.name in self.e.forced else ""

    def default_out_spec(self, node):
        v = node.meta.get("val")

        def one(t):
            if not _is_tensor_val(t):
                return None
            sh = self.e.shapes.probe(t.shape)
            rows = sh and SymbolicSizes.is_rows(sh[0])
            return ShardSpec(dims=tuple(self.batch_axes if (rows and self.batch_axes and i == 0) else ()
                                        for i, s in enumerate(sh)))

        if isinstance(v, (list, tuple)):
            return tuple(one(t) for t in v)
        return one(v)

    # ----- look-ahead helpers for the Linear policies
    def output_segments(self, node) -> int:
        """Number of equal blocks a later ``split`` cuts this Linear's output into (fused QKV)."""
        n = self.e.shapes.probe(node.meta["val"].shape)[-1]
        cur = node
        for _ in range(8):
            users = list(cur.users)
            if len(users) > 1:
                return self._slice_segments(cur, users)
            if len(users) != 1:
                return 1
            u = users[0]
            if u.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
                outs = u.meta["val"]
                d = (u.args[2] if len(u.args) > 2 else 0)
                sizes = {self.e.shapes.probe(o.shape)[d] for o in outs}
                last = len(cur.meta["val"].shape) - 1
                return len(outs) if len(sizes) == 1 and d % (last + 1) == last else 1
            if u.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
                            aten.contiguous.default) and self.e.shapes.probe(u.meta["val"].shape)[-1] == n:
                cur = u
                continue
            if u.target == aten.add.Tensor and self.e.shapes.probe(u.meta["val"].shape)[-1] == n and \
                    any(isinstance(a, fx.Node) and a.op == "get_attr" for a in u.args):
                cur = u             # its bias, added apart (passes/token_fold.py)
                continue
            return 1
        return 1

    def _slice_segments(self, value, users) -> int:
        """Number of equal pieces when every user slices ``value``'s last dim into
        equal, adjacent, step-1 pieces that cover it (Phi-3's sliced ``qkv_proj``)."""
        shape = self.e.shapes.probe(value.meta["val"].shape)
        last, n = len(shape) - 1, shape[-1]
        pieces = set()
        for u in users:
            if u.target != aten.slice.Tensor:
                return 1
            a = list(u.args) + [None] * 5
            if (a[1] or 0) % len(shape) != last or (a[4] or 1) != 1:
                return 1
            start, end = a[2] or 0, n if a[3] is None else min(a[3], n)
            if not isinstance(start, int) or not isinstance(end, int):
                return 1
            pieces.add((start % n if start < 0 else start, end % n if end < 0 else end))
        sizes = {e - b for b, e in pieces}
        if len(sizes) != 1 or sorted(b for b, _ in pieces) != list(range(0, n, next(iter(sizes)))):
            return 1
        return len(pieces)

    def output_feeds_parallel_consumer(self, node) -> bool:
        """True when every path from this value reaches a Linear, the loss or the
        graph output through ops that keep a feature split (pointwise, views, attention).

        The split's dim is followed through views that cut it into ``[heads, head_dim]``
        (and back), transposes and broadcasting; a norm or reduction over other dims
        than the split one (a per-head q/k norm over ``head_dim`` while the heads are
        split) keeps it local, so it does not stop the split."""
        return not self.split_stop(node)

    def split_stop(self, node) -> str:
        """Why the split of this value's last dim cannot reach a parallel consumer
        (:meth:`output_feeds_parallel_consumer`): the first op found that stops it, its
        node and what it does to the split dim; empty when every path passes."""
        seen: set[tuple[str, int | None]] = set()
        rank_of = lambda n: getattr(n.meta.get("val"), "ndim", None)          # noqa: E731
        out_rank = rank_of(node)
        stack = [(u, node, out_rank - 1 if out_rank else None) for u in node.users]
        while stack:
            u, src, d = stack.pop()
            if (u.name, d) in seen:
                continue
            seen.add((u.name, d))
            ann = self.e.ann.get(u.name)
            if u.op == "output" or u.target in (aten._assert_tensor_metadata.default, aten.sym_size.int):
                continue
            if ann and ann.kind in ("linear", "loss"):
                continue
            t = u.target
            if t in _SPLITS:        # pieces along another dim keep the split (rotary halves: chunk over head_dim)
                dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)
                rank = len(_shape(src) or ())
                nd = d if d is not None and rank and isinstance(dim, int) and dim % rank != d else None
                stack.extend((w, u, nd) for w in u.users)
                continue
            if t == operator.getitem and getattr(src, "target", None) in _SPLITS | {aten.max.dim, aten.min.dim}:
                stack.extend((w, u, d) for w in u.users)      # one piece (or the values / indices) of it
                continue
            if ann and ann.kind in ("norm", "reduction"):
                nd = _reduced_keeps(u, src, d)
                if nd is None and _is_statistic(u, src, d):
                    continue        # a norm's statistic over the split dim: a partial sum, all-reduced where used
                if nd is None:
                    return _stop(u, f"a {ann.kind} over the split dim" if d is not None
                                 else f"a {ann.kind} after an op that loses track of the split dim")
                stack.extend((w, u, nd) for w in u.users)
                continue
            if ann and ann.kind == "embedding":
                return _stop(u, "a lookup that reads it as indices")
            if t in _PASS_THROUGH or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
                nd = _contract_dim(u, src, d) if t in _CONTRACTS else _broadcast_dim(u, src, d)
                stack.extend((w, u, nd) for w in u.users)
                continue
            if t == aten.type_as.default:       # a cast (Gemma-3's norms): the split passes; a dtype donor's does not
                if u.args[0] is src:
                    stack.extend((w, u, d) for w in u.users)
                continue
            if t in (aten.max.dim, aten.min.dim):       # a search along another dim: both outputs keep the split
                nd = _reduced_keeps(u, src, d)
                if nd is None:
                    return _stop(u, "a search over the split dim" if d is not None
                                 else "a search after an op that loses track of the split dim")
                stack.extend((w, u, nd) for w in u.users)
                continue
            if t in (aten.index_copy_.default, aten.index_copy.default):     # rows written into a cache:
                stack.extend((w, u, d) for w in u.users)                     # the same dims, another length
                continue
            if t == operator.getitem or (ann and ann.kind in ("view", "attention")):
                nd = _view_dim(u, src, d) if ann and ann.kind == "view" else None
                stack.extend((w, u, nd) for w in u.users)
                continue
            return _stop(u, "an op with no rule that keeps a feature split")
        return ""

    def is_largest_embedding(self, w) -> bool:
        return w.target == self.e.largest_embedding


_CONTRACTS = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default,
              aten.scaled_dot_product_attention.default}


def _shape(n):
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(v.shape) if hasattr(v, "shape") else None


def _stop(u, what: str) -> str:
    """``"`aten.mean.dim` at node `mean_3` (a norm over the split dim)"``: the op that
    stops a split, for a plan note."""
    return f"`{_aten_name(u)}` at node `{u.name}` ({what})"


def _aten_name(node) -> str:
    t = node.target
    return str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))


_SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default})


def _contract_dim(u, src, d):
    """The split dim ``d`` of ``src`` in the output of the matmul ``u`` when it is one of
    its batch dims (attention's heads through ``QKᵀ`` and ``PV``); None otherwise."""
    a = _shape(src)
    if d is None or a is None or u.target not in (aten.matmul.default, aten.bmm.default) or d >= len(a) - 2:
        return None
    return _broadcast_dim(u, src, d)


def _broadcast_dim(u, src, d):
    """The split dim ``d`` of ``src`` in the output of the pointwise ``u`` (broadcasting
    prepends dims); None where unknown."""
    a, b = _shape(src), _shape(u)
    if d is None or a is None or b is None or len(b) < len(a):
        return None
    return d + len(b) - len(a)


def _view_dim(u, src, d):
    """The split dim ``d`` of ``src`` in the output of the view ``u``: kept by a view that
    keeps the dims up to it, moved by a transpose, kept on the outer factor when the dim
    is cut in two (``[.., heads·hd] → [.., heads, hd]``) or merged with its inner neighbour
    (and back); None where unknown (the caller then stops at the next norm), sizes that
    depend on data (an unbacked ``u8`` no comparison can decide: Idefics3's connector) too."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        return _view_dim_of(u, src, d)
    except GuardOnDataDependentSymNode:
        return None


def _view_dim_of(u, src, d):
    a, b = _shape(src), _shape(u)
    if d is None or a is None or b is None:
        return None
    if u.target == aten.transpose.int:
        i, j = (x % len(a) for x in u.args[1:3])
        return j if d == i else i if d == j else d
    if u.target == aten.unsqueeze.default:          # a new size-1 dim (repeat_kv's [:, :, None])
        p = u.args[1] % len(b)
        return d if d < p else d + 1
    if u.target == aten.expand.default:             # broadcast to more (or new leading) dims
        return d + len(b) - len(a) if b[d + len(b) - len(a)] == a[d] else None
    if u.target not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return None
    if a[:d] != b[:d]:
        return None
    if len(b) > d and b[d] == a[d] and a[d + 1:] == b[d + 1:]:
        return d
    if len(b) == len(a) + 1 and len(b) > d + 1 and b[d] * b[d + 1] == a[d] and a[d + 1:] == b[d + 2:]:
        return d                                   # cut in two: the split stays on the outer factor
    if len(a) == len(b) + 1 and len(a) > d + 1 and a[d] * a[d + 1] == b[d] and a[d + 2:] == b[d + 1:]:
        return d                                   # merged with its inner neighbour
    return None


def _reduced_keeps(u, src, d):
    """Where the split dim ``d`` of ``src`` is in the output of the norm / reduction ``u``
    when ``u`` does not reduce over it; None when it does (or when unknown)."""
    a, b = _shape(src), _shape(u)
    if d is not None and a is not None and u.target in (aten.max.dim, aten.min.dim) and u.args[0] is src:
        dim = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", -1)    # values and indices (a tuple)
        if not isinstance(dim, int) or dim % len(a) == d:
            return None
        keep = u.args[2] if len(u.args) > 2 else u.kwargs.get("keepdim", False)
        return d if keep or dim % len(a) > d else d - 1
    if d is None or a is None or b is None or not u.args or u.args[0] is not src:
        return None
    if u.target in (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var.correction):
        dims = u.args[1] if len(u.args) > 1 else None
        if not isinstance(dims, (list, tuple)) or not dims:
            return None
        red = {x % len(a) for x in dims}
        if d in red:
            return None
        keep = (u.args[2] if len(u.args) > 2 else u.kwargs.get("keepdim", False))
        return d if keep else d - sum(1 for r in red if r < d)
    if u.target == aten.layer_norm.default:
        return d if d < len(a) - len(u.args[1]) else None
    return None


def _is_statistic(u, src, d) -> bool:
    """``u`` is a mean or sum over exactly the split dim ``d`` of ``src``, kept as a
    size-1 dim: an RMSNorm's mean square over features split across ranks (OLMo-2's
    q/k norms over the whole projection). Its value is a partial sum the first op not
    linear in it all-reduces (``[..., 1]`` per token), and the normalised features keep
    their split: a distributed norm with no gather of the features."""
    a = _shape(src)
    if d is None or a is None or not u.args or u.args[0] is not src:
        return False
    if u.target not in (aten.mean.dim, aten.sum.dim_IntList):
        return False
    dims = u.args[1] if len(u.args) > 1 else None
    keep = u.args[2] if len(u.args) > 2 else u.kwargs.get("keepdim", False)
    return isinstance(dims, (list, tuple)) and {x % len(a) for x in dims} == {d} and bool(keep)


_PASS_THROUGH = {aten.dropout.default, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                 aten.scaled_dot_product_attention.default, aten.to.dtype, aten.to.dtype_layout,
                 aten._to_copy.default, aten.slice.Tensor, aten.cat.default, aten.matmul.default,
                 aten.bmm.default, aten.softmax.int, aten._softmax.default, aten.stack.default,
                 aten.baddbmm.default, aten.flatten.using_ints}


class _Engine:
    def __init__(self, captured, policy: Policy, *, batch_size: int, seq_len: int, gather_outputs: bool,
                 dropout: str = "sharded", pinned: dict | None = None, frozen: frozenset[str] | None = None):
        self.cap = captured
        self.pinned = dict(pinned or {})
        self.gm: fx.GraphModule = captured.module
        self.policy = policy
        self.mesh = policy.mesh
        self.training = captured.training
        self.gather_outputs = gather_outputs
        self.dropout = dropout
        self.batch_size, self.seq_len = batch_size, seq_len
        self.params = param_names(self.gm)
        # constants for the backward (docs/design.md, frozen parameters): by every name of the tensor
        self.frozen = frozenset(frozen) if frozen is not None else frozenset(
            n for n, p in self.gm.named_parameters(remove_duplicate=False) if not p.requires_grad)
        self.state = frozenset(state_inputs(self.gm))
        # data parallelism: each dp replica is handed its own batch, so the batch dim
        # is split over dp before the graph starts; the policy's batch axes split it further
        self.dp_axes = ("dp",) if "dp" in self.mesh.axes else ()
        self.batch_axes = self.dp_axes + tuple(policy.batch_axes)
        # a static batch (the model reads it as a Python int) is never split: every rank holds
        # all its rows (docs/design.md, "Inputs"); the pipeline refuses it with dp or cp
        self.static_batch = captured.batch_symbol is None
        if self.static_batch:
            self.batch_axes = ()
        # context parallelism: the sequence is split over cp from the token lookups on
        # (docs/design.md, "Context parallelism")
        self.cp_axes = ("cp",) if self.mesh.cp > 1 else ()
        self.ann = annotate(self.gm)
        self.forced: set[str] = set()
        # Linear -> why a re-plan holds it whole (the op that refused its split), for its note
        self.forced_why: dict[str, str] = {}
        self.needs_grad = self._needs_grad()
        embs = [(n.args[0].meta["val"].numel(), n.args[0].target) for n in self.gm.graph.nodes
                if n.op == "call_function" and n.target == aten.embedding.default
                and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr"]
        self.largest_embedding = max(embs)[1] if embs else None

    # ------------------------------------------------------------ grad analysis
    def _needs_grad(self) -> set[str]:
        out: set[str] = set()
        for n in self.gm.graph.nodes:
            v = n.meta.get("val")
            if n.op == "get_attr":
                if n.target in self.params and n.target not in self.frozen and _is_tensor_val(v) \
                        and v.is_floating_point():
                    out.add(n.name)
                continue
            if n.op != "call_function":
                continue
            if n.target is torch.ops.higher_order.wrap_with_set_grad_enabled and n.args and n.args[0] is False:
                continue
            if n.target in (aten.detach.default, aten.sym_size.int):
                continue
            floating = any(_is_tensor_val(t) and t.is_floating_point()
                           for t in (v if isinstance(v, (list, tuple)) else [v]))
            if floating and any(a.name in out for a in n.all_input_nodes):
                out.add(n.name)
        return out & self._live()

    def _live(self) -> set[str]:
        """The nodes an output depends on: backward reaches no other (LLaVA's vision
        tower computes a last layer whose output it never reads)."""
        live: set[str] = set()
        for n in reversed(self.gm.graph.nodes):
            if n.op == "output" or any(u.name in live for u in n.users):
                live.add(n.name)
        return live

    # ------------------------------------------------------------------- run
    def run(self) -> ShardingPlan:
        # a pass collects every Linear whose output a later op cannot take split
        # (e.g. q/k/v when the heads do not divide); the next pass replicates them
        # all. Each retry replicates at least one more Linear: the number of Linears
        # bounds the passes (in practice one or two).
        bound = 1 + sum(1 for a in self.ann.values() if a.kind == "linear")
        for _ in range(bound):
            try:
                return self._run_once()
            except _Retry as r:
                new = r.linears - self.forced
                if not new:
                    break
                self.forced |= new
        raise ShardingError(f"planning did not settle after re-planning {len(self.forced)} Linears")

    def _run_once(self) -> ShardingPlan:
        self.shapes = _Shapes(self.cap.batch_symbol, self.cap.seq_symbol, self.batch_size, self.seq_len)
        self.st = _State({}, dict(self.pinned), {}, set(), {}, set(), {})
        self.rows = self._row_facts()
        self.st_pending: set[str] = set()       # Linears to replicate in the next pass
        nodes: list[NodePlan] = []
        for node in self.gm.graph.nodes:
            np_ = self._visit(node)
            if np_ is not None:
                nodes.append(np_)
        if self.st_pending:
            raise _Retry(self.st_pending)
        if self.cp_axes and not any(isinstance(sp, ShardSpec) and "cp" in sp.axes for sp in self.st.specs.values()):
            raise ShardingError(f"cp={self.mesh.cp}: no value of {self.cap.model_name}'s graph has a "
                                f"sequence dim the context-parallel split can cut (it starts at a token lookup "
                                f"whose rows carry the sequence symbol; this graph has none, e.g. a sequence "
                                f"torch.export made static); valid here: cp=1")
        nodes = self._state_nodes() + nodes
        nodes = self._settle_param_grads(nodes)
        params = []
        groups: dict[int, list[str]] = {}
        tensors = {}
        for name, p in self.gm.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
            tensors[id(p)] = p
        for key, names in groups.items():
            p = tensors[key]
            used = [n for n in names if n in self.st.param_spec]
            name = used[0] if used else names[0]
            spec = self.st.param_spec.get(name, replicated(p.dim()))
            sync = tuple(a for a in self.mesh.axes if a in self.st.param_sync.get(name, set()))
            dense = ()
            pad = next((x for x in getattr(self.cap, "padding", ()) if name in x.names), None)
            if pad is not None:
                dense = tuple(pad.dense if d == pad.dim else s for d, s in enumerate(p.shape))
            params.append(ParamPlan(name=name, global_shape=tuple(p.shape), spec=spec, grad_sync=sync,
                                    dtype_bytes=p.element_size(), aliases=tuple(n for n in names if n != name),
                                    dense_shape=dense, trainable=not self.frozen & set(names),
                                    pad_segments=getattr(pad, "segments", 1), pad_copies=getattr(pad, "copies", 0),
                                    pad_unit=getattr(pad, "unit", 0)))
        local = {n.name: self._local_shape(n) for n in self.gm.graph.nodes}
        return ShardingPlan(model=self.cap.model_name, mode=self.policy.name, mesh=self.mesh,
                            tp_axes=self.policy.tp_axes, batch_axes=() if self.static_batch else self.policy.batch_axes,
                            batch_size=self.batch_size, seq_len=self.seq_len, nodes=tuple(nodes),
                            params=tuple(params), dp=self.policy.dp, cp_order=self.policy.cp_order,
                            cp_attention=self.policy.cp_attention,
                            local_shapes=local)

    def _state_nodes(self) -> list[NodePlan]:
        """A row per state input (:func:`state_inputs`): the layout its first write
        gave it, which is the block each rank allocates and passes."""
        out = []
        for n in self.gm.graph.nodes:
            if n.name not in self.state:
                continue
            spec = self.st.specs.setdefault(n.name, replicated(n.meta["val"].dim()))
            g = self.shapes.concrete(n.meta["val"].shape)
            local = spec.local_shape(g, self.mesh)
            out.append(NodePlan(name=n.name, op="placeholder", kind="state", module="", out_spec=spec,
                                global_shape=g, local_shape=local,
                                param_bytes=math.prod(local) * n.meta["val"].element_size(),
                                notes=("state written in place (KV cache): each rank passes its block",)))
        return out

    def _row_facts(self) -> dict:
        """:func:`~autoshard.passes.row_order.row_facts` of the graph: a fact of the graph and
        its sizes alone, so inside :func:`remember_row_facts` (a search planning one graph
        per candidate) read back, with the probe sizes it drew, for the same graph."""
        key = (id(self.gm), self.cap.batch_symbol, self.cap.seq_symbol, self.batch_size, self.seq_len)
        sh = self.shapes
        if _ROW_MEMO is not None and key in _ROW_MEMO:
            _, facts, probe, conc, drawn = _ROW_MEMO[key]
            sh.probe_map.update(probe)
            sh.conc_map.update(conc)
            for _ in range(drawn):          # the same primes for the symbols probed later
                next(sh._extra)
            return facts
        before = len(sh.probe_map)
        facts = row_facts(self.gm, sh.probe, SymbolicSizes.is_rows)
        if _ROW_MEMO is not None:
            _ROW_MEMO[key] = (self.gm, facts, dict(sh.probe_map), dict(sh.conc_map), len(sh.probe_map) - before)
        return facts

    def _local_shape(self, node: fx.Node):
        """Local shape of a graph value under the specs just chosen (a tuple of
        shapes for a multi-output node; the global shape where no spec splits it)."""
        v, spec = node.meta.get("val"), self.st.specs.get(node.name)

        def one(t, sp):
            if not _is_tensor_val(t):
                return None
            g = self.shapes.concrete(t.shape)
            return sp.local_shape(g, self.mesh) if isinstance(sp, ShardSpec) else g

        if isinstance(v, (list, tuple)):
            return tuple(one(t, spec[i] if isinstance(spec, tuple) and i < len(spec) else None)
                         for i, t in enumerate(v))
        return one(v, spec)

    def _settle_param_grads(self, nodes: list[NodePlan]) -> list[NodePlan]:
        """A parameter used several times may get partial gradients over different
        axes per use (a tied table: lookup partial over the batch axes, head
        partial over fewer). Sum what all uses share once after backward; a use
        partial over more axes gets an in-graph ``copy_to`` for the extra ones."""
        import dataclasses

        index = {n.name: i for i, n in enumerate(nodes)}
        for target, uses in self.st.param_uses.items():
            common = frozenset.intersection(*[u[2] for u in uses])
            self.st.param_sync[target] = set(common)
            for name, path, rep in uses:
                extra = tuple(a for a in self.mesh.axes if a in rep - common)
                if not extra:
                    continue
                i = index[name]
                np_ = nodes[i]
                node = next(n for n in self.gm.graph.nodes if n.name == name)
                a = _get(node, path)
                step = Step(op="copy_to", axes=extra)
                comms = self._step_comms(a, self.st.param_spec[target], (step,), True)
                nodes[i] = dataclasses.replace(np_, arg_steps=np_.arg_steps + ((path, (step,)),),
                                               comms=np_.comms + tuple(comms),
                                               notes=np_.notes + (f"{target} grad summed over {','.join(extra)} here",))
        return nodes

    # ------------------------------------------------------------- per node
    def _visit(self, node: fx.Node) -> NodePlan | None:
        ann = self.ann.get(node.name, Annotation("other", ""))
        if node.op == "placeholder":
            return self._placeholder(node, ann)
        if node.op == "get_attr":
            v = node.meta.get("val")
            if node.target not in self.params:
                self.st.specs[node.name] = replicated(v.dim()) if _is_tensor_val(v) else None
            return None
        if node.op == "output":
            return self._output(node)
        if node.op == "call_module":
            self.st.specs[node.name] = None
            return None
        ctx = _Ctx(self, node)
        self._check_row_order(node, ctx)
        choice = self._choose(node, ann, ctx)
        if self.cp_axes and (ann.kind == "embedding" or any(a.name in self.st.cp_pending for a in node.all_input_nodes)):
            choice = self._cp_split(node, ctx, choice)
        return self._apply(node, ann, ctx, choice)

    def _cp_split(self, node, ctx, choice: Choice) -> Choice:
        """Context parallelism starts here: a lookup's rows are cut on the sequence over
        ``cp`` (each rank keeps its block, no collective; backward all-gathers the
        gradient, so the table's own gradient is complete and takes no cp sync). A
        lookup whose rows are still partial sums (1d's vocab-parallel tables, reduced after
        their add) is cut at the first value after it that is not. What the sequence meets
        later (positions, masks, labels) is whole and sliced where it meets the split rows."""
        out = choice.out
        if not isinstance(out, ShardSpec) or not _is_tensor_val(node.meta.get("val")):
            return choice
        seq = [d for d, v in enumerate(ctx.pshape(node)) if v == SymbolicSizes.SEQ]
        if len(seq) != 1 or out.dims[seq[0]]:
            return choice
        if out.partial:
            self.st.cp_pending.add(node.name)
            return choice
        d = seq[0]
        return choice.replace(out=out.with_dim(d, self.cp_axes),
                              post=choice.post + (Step(op="scatter", axes=self.cp_axes, dim=d),),
                              notes=choice.notes + (f"sequence split over {','.join(self.cp_axes)} "
                                                    f"(context parallel)",))

    def _check_row_order(self, node, ctx):
        """Rows a sort put in a rank-local order (:mod:`.row_order`) are exact only
        through ops that treat rows one by one or index them by their own positions."""
        f = self.rows.get(node.name)
        if not self.batch_axes or not any(isinstance(x, RowFact) and x.order == CONFLICT
                                          for x in (f if isinstance(f, tuple) else (f,))):
            return
        split = [a.name for a in node.all_input_nodes if isinstance(ctx.spec(a), ShardSpec) and ctx.spec(a).ndim
                 and set(ctx.spec(a).dims[0]) & set(self.batch_axes)]
        if split:
            raise ShardingError(f"rows sorted on each rank's own tokens (a rank-local order) reach an op that "
                                f"does not treat rows one by one or meets rows of another order ({', '.join(split)}); "
                                f"with the batch split over {','.join(self.batch_axes)} its local result would not "
                                f"be a block of the dense one", node=node)

    def _placeholder(self, node, ann) -> NodePlan | None:
        v = node.meta.get("val")
        if node.name in self.state:         # laid out by its first write (index_copy rule)
            return None
        if not _is_tensor_val(v):
            self.st.specs[node.name] = None
            return None
        sh = self.shapes.probe(v.shape)
        b = self.policy.batch_axes
        if self.batch_axes and sh and sh[0] == _PRIME_BATCH:
            spec = replicated(len(sh)).with_dim(0, self.batch_axes)
            self.st.specs[node.name] = spec
            if not b:
                return None
            return NodePlan(name=node.name, op="placeholder", kind="input", module="", out_spec=spec,
                            post=(Step(op="scatter", axes=b, dim=0),), global_shape=self.shapes.concrete(v.shape),
                            local_shape=spec.local_shape(self.shapes.concrete(v.shape), self.mesh),
                            notes=(f"batch split over {','.join(b)}",))
        self.st.specs[node.name] = replicated(len(sh))
        return None

    def _rule(self, node, ann: Annotation, ctx) -> Choice:
        """The policy's or the generic rule's choice; a rule that fails for any reason
        but :class:`NeedReplicate` is re-raised naming the node, its module and its input specs."""
        if ann.kind == "linear":
            rule = self.policy.linear
        elif ann.kind == "embedding":
            rule = self.policy.embedding
        else:
            rule = rule_for(node)
        try:
            return rule(ctx)
        except (NeedReplicate, ShardingError, _Retry):
            raise
        except Exception as e:  # noqa: BLE001 - a rule's bug, reported where it happened
            specs = {a.name: ctx.spec(a) for a in node.all_input_nodes}
            raise ShardingError(f"the {getattr(rule, '__qualname__', rule)} rule failed: {type(e).__name__}: {e}",
                                node=node, specs=specs) from e

    def _choose(self, node, ann: Annotation, ctx) -> Choice:
        try:
            return self._rule(node, ann, ctx)
        except NeedReplicate as nr:
            src = _get(node, nr.path)
            origin = self.st.origin.get(src.name) if isinstance(src, fx.Node) else None
            if origin and origin not in self.forced:
                # this pass goes on with the input gathered so that it finds every
                # such Linear; its plan is discarded and the next replicates them
                self.st_pending.add(origin)
                self.forced_why.setdefault(origin, f"the split of its out features could not pass "
                                                   f"{_stop(node, nr.reason)}")
                try:
                    return self._gathered_choice(node, ann, ctx, nr)
                except ShardingError:
                    raise _Retry(self.st_pending) from None
            # gather the offending input dim and try again with it replicated
            return self._gathered_choice(node, ann, ctx, nr)

    def _gathered_choice(self, node, ann, ctx, nr: NeedReplicate) -> Choice:
        src = _get(node, nr.path)
        s = ctx.spec(src)
        if not s.dims[nr.dim]:
            raise ShardingError(f"no layout fits: input {nr.path} dim {nr.dim} is already whole and the rule "
                                f"still refuses it ({nr.reason})", node=node)
        size = ctx.pshape(src)[nr.dim]
        if SymbolicSizes.is_rows(size) and set(s.dims[nr.dim]) & set(self.batch_axes):
            # sizes later in the graph are read from the local batch: a gathered batch would not fit them
            raise ShardingError(f"cannot gather the batch split of input {nr.path} dim {nr.dim} "
                                f"({nr.reason}); the graph reads local batch sizes after it", node=node)
        saved = self.st.specs[src.name]
        self.st.specs[src.name] = s.with_dim(nr.dim, ())
        try:
            choice = self._choose(node, ann, ctx)
        finally:
            self.st.specs[src.name] = saved
        inputs = dict(choice.inputs)
        req = inputs.get(nr.path)
        if req is None or req.dims[nr.dim]:
            inputs[nr.path] = s.with_dim(nr.dim, ())
        return choice.replace(inputs=inputs, fallback=True,
                              notes=choice.notes + (f"fallback: gathered input dim {nr.dim}: {nr.reason}",))

    def _apply(self, node, ann, ctx, choice: Choice) -> NodePlan | None:
        """Record ``choice`` for ``node``: its inputs' re-layouts and their collectives, the
        kernel's collectives, its output spec, and its row of the plan (None for a node
        that neither splits nor runs a kernel)."""
        arg_steps, in_specs = self._bind_inputs(node, ctx, choice)
        arg_steps = self._grad_steps(node, choice, in_specs, arg_steps)
        comms = self._relayout_comms(node, ctx, arg_steps) + self._kernel_comm_rows(node, choice, in_specs)
        out = choice.out
        cuts = tuple(st for st in choice.post if st.op == "scatter")
        if cuts and isinstance(out, ShardSpec):      # a cut output (context parallelism): its backward gather
            comms += self._step_comms(node, _before_cuts(choice), cuts, node.name in self.needs_grad)
        self.st.specs[node.name] = out
        self._track_batch_index(node, out)
        self._track_origin(node, ann, choice, in_specs)
        if out is None and not choice.kernel:
            return None
        return self._node_plan(node, ann, choice, arg_steps, in_specs, comms)

    def _bind_inputs(self, node, ctx, choice: Choice) -> tuple[list, dict]:
        """(re-layout steps per input path, spec per input path) for the layouts the choice
        asks of ``node``'s inputs: a parameter's layout is fixed by its first use, a free
        state input takes the one asked, any other value is re-laid from its own."""
        arg_steps = []
        in_specs = {}
        for path, req in choice.inputs.items():
            a = _get(node, path)
            if not isinstance(a, fx.Node):
                continue
            in_specs[path] = req
            if a.op == "get_attr" and a.target in self.params:
                self._bind_param(node, a, req)
            elif ctx.is_free_state(a):        # a state input takes the layout its first write needs
                self.st.specs[a.name] = req
            else:
                steps = self._relayout(node, ctx, a, req)
                if steps:
                    arg_steps.append((path, tuple(steps)))
        return arg_steps, in_specs

    def _bind_param(self, node, a: fx.Node, req: ShardSpec) -> None:
        """Fix parameter ``a``'s layout at its first use; a later use must ask the same."""
        fixed = self.st.param_spec.get(a.target)
        if fixed is None:
            self.st.param_spec[a.target] = req
        elif fixed != req:
            raise ShardingError(f"parameter {a.target} is already split as {fixed} by an earlier use; "
                                f"this use needs {req}", node=node)

    def _relayout(self, node, ctx, a: fx.Node, req: ShardSpec) -> list[Step]:
        """Steps from ``a``'s layout to ``req``; refused where they would move rows that
        a sort put in a rank-local order."""
        cur = ctx.spec(a)
        steps = _redistribute(cur, req, self.mesh)
        if steps and cur.ndim and req.ndim and cur.dims[0] != req.dims[0] \
                and ctx.row_fact(a).order is not None:
            raise ShardingError(f"input {a.name} holds its rows in a rank-local order (sorted on each rank's "
                                f"own tokens); re-laying its rows from {cur.dims[0] or 'whole'} to "
                                f"{req.dims[0] or 'whole'} would mix the ranks' orders", node=node)
        return steps

    def _grad_steps(self, node, choice: Choice, in_specs: dict, arg_steps: list) -> list:
        """``arg_steps`` with the grad invariant kept: a replicated input of an op whose
        output is split / partial gets ``copy_to`` (a parameter: its after-backward sync)."""
        # the op's own output: a step after it that cuts it (context parallelism's scatter)
        # keeps the op's gradient complete over those axes, its backward all-gathers
        out_axes = _spec_axes(_before_cuts(choice))
        for path, req in in_specs.items():
            a = _get(node, path)
            if a.name not in self.needs_grad or path in choice.grad_complete:
                continue
            rep = tuple(ax for ax in self.mesh.axes if ax in out_axes and ax not in req.axes and ax not in req.partial)
            if path in choice.param_sync:
                rep = choice.param_sync[path]
            if a.op == "get_attr" and a.target in self.params:
                # a use with a complete gradient counts too: a tied table's other use then
                # sums its partial part in the graph, not the complete one after backward
                self.st.param_uses.setdefault(a.target, []).append((node.name, path, frozenset(rep)))
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
        return arg_steps

    def _relayout_comms(self, node, ctx, arg_steps: list) -> list[Comm]:
        """The collectives of ``arg_steps``; identical re-layouts of one value are made once
        and shared (one backward all-reduce for q, k and v reading the same normed hidden state)."""
        comms: list[Comm] = []
        for path, steps in arg_steps:
            a = _get(node, path)
            key = (a.name, steps)
            if key in self.st.relayouts:
                continue
            self.st.relayouts.add(key)
            comms += self._step_comms(a, ctx.spec(a), steps, a.name in self.needs_grad)
        return comms

    def _kernel_comm_rows(self, node, choice: Choice, in_specs: dict) -> list[Comm]:
        """The kernel's collectives as plan rows, less the backward ones whose gradient
        nothing needs."""
        comms: list[Comm] = []
        for kc in self._kernel_comms(node, choice, in_specs):
            if kc.phase == "bwd" and node.name not in self.needs_grad:    # backward never reaches it
                continue
            if kc.phase == "bwd" and kc.needs_grad_of:
                if not any(isinstance(_get(node, p), fx.Node) and _get(node, p).name in self.needs_grad
                           for p in kc.needs_grad_of):
                    continue
            comms.append(Comm(phase=kc.phase, kind=kc.kind, axes=kc.axes, group_size=self.mesh.size(kc.axes),
                              buffer_bytes=kc.numel * _elem_bytes(node)))
        return comms

    def _track_batch_index(self, node, out) -> None:
        """Remember values that index the rank's own batch rows (a split ``arange`` and
        what reshapes or offsets it)."""
        if node.target == aten.arange.default and isinstance(out, ShardSpec) and out.ndim == 1 and out.dims[0]:
            self.st.batch_index.add(node.name)
        if node.target in (aten.unsqueeze.default, aten.view.default, aten.expand.default, aten.add.Tensor) and \
                any(isinstance(a, fx.Node) and a.name in self.st.batch_index for a in node.args):
            self.st.batch_index.add(node.name)

    def _param_bytes(self, node, ann, in_specs: dict) -> int:
        """Bytes of the parameters a Linear / embedding / norm holds on one rank."""
        pbytes = 0
        if ann.kind not in ("linear", "embedding", "norm"):
            return pbytes
        for path, req in in_specs.items():
            a = _get(node, path)
            if a.op == "get_attr" and a.target in self.params:
                pbytes += math.prod(req.local_shape(self.shapes.concrete(a.meta["val"].shape), self.mesh)) * \
                    a.meta["val"].element_size()
        return pbytes

    def _linear_flops(self, node, ann, gshape) -> int:
        """Dense forward FLOPs of a Linear (``2·N·k·n``); 0 for any other node."""
        if ann.kind != "linear" or not gshape:
            return 0
        _, wp, _, nd, kd = linear_operands(node)
        w = _get(node, wp)
        if isinstance(w, fx.Node) and _is_tensor_val(w.meta.get("val")):
            ws = self.shapes.concrete(w.meta["val"].shape)
            if len(ws) > max(nd, kd):
                return 2 * math.prod(gshape[:-1]) * ws[nd] * ws[kd]
        return 0

    def _node_plan(self, node, ann, choice: Choice, arg_steps: list, in_specs: dict, comms: list) -> NodePlan:
        """``node``'s row of the plan."""
        out = choice.out
        v = node.meta.get("val")
        gshape = self.shapes.concrete(v.shape) if _is_tensor_val(v) else ()
        lshape = out.local_shape(gshape, self.mesh) if isinstance(out, ShardSpec) and gshape else ()
        return NodePlan(name=node.name, op=_op_name(node), flops=self._linear_flops(node, ann, gshape),
                        kind=ann.kind if ann.kind in ("linear", "norm", "attention", "embedding", "loss") else "other",
                        module=ann.module, out_spec=out, kernel=choice.kernel, arg_steps=tuple(arg_steps),
                        post=tuple(choice.post), patches=tuple(choice.patches.items()), comms=tuple(comms),
                        global_shape=gshape, local_shape=lshape, weight=choice.weight,
                        param_bytes=self._param_bytes(node, ann, in_specs),
                        notes=tuple(n for n in choice.notes if n) + self._whole_note(node, ann, in_specs, choice.notes)
                        + self._row_order_note(node),
                        fallback=choice.fallback)

    def _row_order_note(self, node) -> tuple[str, ...]:
        """A note where the batch split leaves this value's rows in a rank-local order (rows
        sorted by expert on each rank's own tokens, :mod:`.row_order`), or makes its values
        positions among the rank's rows: exact, but its local block is not a block of the
        dense value (``autoshard verify`` compares it where the order is undone)."""
        f = self.rows.get(node.name)
        facts = f if isinstance(f, tuple) else (f,)
        if not self.batch_axes or not any(isinstance(x, RowFact) and (x.order is not None or x.index_into is not None)
                                          for x in facts):
            return ()
        return (LOCAL_ROWS_NOTE,)

    def _whole_note(self, node, ann, in_specs: dict, notes: tuple) -> tuple[str, ...]:
        """A note for a Linear or lookup whose weight the rule held whole over every
        tensor-parallel axis without saying why (every held-whole weight must say why:
        the plan reads as split otherwise); empty where it is split or already explained."""
        tp = tuple(a for a in self.policy.tp_axes if a not in ("dp", "dep"))
        if ann.kind not in ("linear", "embedding") or self.mesh.size(tp) <= 1 \
                or any(n.startswith("whole:") for n in notes):
            return ()
        wp = linear_operands(node)[1] if ann.kind == "linear" else (0,)
        w, req = _get(node, wp), in_specs.get(wp)
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and w.target in self.params and req is not None):
            return ()
        if set(req.axes) & set(tp):
            return ()
        return (f"whole: the {self.policy.name} rule found no split of `{w.target}` over "
                f"{','.join(tp)} for `{_aten_name(node)}`",)

    def _track_origin(self, node, ann, choice, in_specs):
        if ann.kind == "linear" and not choice.kernel and isinstance(choice.out, ShardSpec) and choice.out.dims[-1]:
            self.st.origin[node.name] = node.name
            return
        for a in node.all_input_nodes:
            o = self.st.origin.get(a.name)
            if o and ann.kind not in ("linear", "norm", "attention", "loss"):
                self.st.origin[node.name] = o
                return

    def _step_comms(self, a: fx.Node, cur: ShardSpec, steps, needs_grad: bool) -> list[Comm]:
        shape = self.shapes.concrete(a.meta["val"].shape)
        eb = a.meta["val"].element_size()
        out: list[Comm] = []
        s = cur
        for st in steps:
            comms, s = st.effect(s, shape, self.mesh, eb, needs_grad)
            out += comms
        return out

    def _kernel_comms(self, node, choice: Choice, in_specs: dict):
        """The kernel's collectives for the local shapes of this plan (none without a kernel)."""
        if choice.kernel is None:
            return ()
        shapes = {}
        for path, req in in_specs.items():
            a = _get(node, path)
            if isinstance(a, fx.Node) and _is_tensor_val(a.meta.get("val")):
                shapes[path] = req.local_shape(self.shapes.concrete(a.meta["val"].shape), self.mesh)
        v = node.meta.get("val")
        out = _before_cuts(choice)       # the kernel's own output, before a cut after it
        oshape = out.local_shape(self.shapes.concrete(v.shape), self.mesh) \
            if isinstance(out, ShardSpec) and _is_tensor_val(v) else ()
        return choice.kernel.comms(KernelIO(in_shapes=shapes, out_shape=oshape, mesh=self.mesh))

    def _output(self, node) -> NodePlan | None:
        arg_steps = []
        comms = []
        flat = node.args[0]
        items = list(flat) if isinstance(flat, (list, tuple)) else [flat]
        for i, a in enumerate(items):
            if not isinstance(a, fx.Node):
                continue
            s = self.st.specs.get(a.name)
            if not isinstance(s, ShardSpec) or s.is_replicated or not self.gather_outputs:
                continue
            # dp replicas keep their own rows: gather everything else
            keep = ShardSpec(dims=tuple(tuple(x for x in d if x in self.dp_axes) for d in s.dims))
            steps = _redistribute(s, keep, self.mesh)
            if not steps:
                continue
            arg_steps.append(((0, i), tuple(steps)))
            comms += self._step_comms(a, s, steps, False)
        if not arg_steps:
            return None
        return NodePlan(name="output", op="output", kind="other", module="", out_spec=None,
                        arg_steps=tuple(arg_steps), comms=tuple(comms), notes=("outputs gathered to full",))


class _Retry(Exception):
    def __init__(self, linears: set[str]):
        self.linears = set(linears)


def _before_cuts(choice: Choice):
    """``choice.out`` as the op itself makes it: the dims its ``scatter`` post-steps cut, whole."""
    out = choice.out
    for st in choice.post:
        if st.op == "scatter" and isinstance(out, ShardSpec):
            out = out.with_dim(st.dim, ())
    return out


def _spec_axes(out) -> set:
    if isinstance(out, ShardSpec):
        return set(out.axes) | set(out.partial)
    if isinstance(out, tuple):
        s: set = set()
        for o in out:
            s |= _spec_axes(o)
        return s
    return set()


def _elem_bytes(node) -> int:
    v = node.meta.get("val")
    if isinstance(v, (list, tuple)):
        v = v[0]
    return v.element_size() if _is_tensor_val(v) else 4


def _op_name(node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.replace("aten::", "") + ("" if t._overloadname == "default" else "." + t._overloadname)
    return getattr(t, "__name__", str(t))


def _redistribute(cur: ShardSpec, req: ShardSpec, mesh: Mesh) -> list[Step]:
    """Steps that turn layout ``cur`` into ``req``: reduce partials (reduce-scatter
    when ``req`` splits a dim over exactly those axes), then gather, then slice."""
    if cur is None or req is None:
        return []
    if cur == req:
        return []
    steps: list[Step] = []
    s = cur
    if s.partial and tuple(s.partial) != tuple(req.partial):
        p = s.partial
        rs_dim = next((d for d in range(req.ndim) if req.dims[d] == p and not s.dims[d]), None)
        if rs_dim is not None and req.segments[rs_dim] == 1:
            steps.append(Step(op="reduce_scatter", axes=p, dim=rs_dim))
            s = s.with_partial(()).with_dim(rs_dim, p)
        else:
            steps.append(Step(op="reduce_from", axes=p))
            s = s.with_partial(())
    for d in range(s.ndim):
        have, want = s.dims[d], req.dims[d]
        if have and (have != want or s.segments[d] != req.segments[d]):
            # gathering only the inner axes keeps the outer block: (dp,row) -> (dp,)
            keep = want if (want and have[:len(want)] == want and s.segments[d] == req.segments[d]) else ()
            steps.append(Step(op="gather", axes=have[len(keep):], dim=d, segments=s.segments[d]))
            s = s.with_dim(d, keep, s.segments[d])
    for d in range(s.ndim):
        have, want = s.dims[d], req.dims[d]
        if want and have != want:
            # have is () or a prefix of want: slice the inner axes locally
            steps.append(Step(op="scatter", axes=want[len(have):], dim=d, segments=req.segments[d]))
            s = s.with_dim(d, want, req.segments[d])
    return steps


#: graph -> its row facts, while :func:`remember_row_facts` is open (None: not remembered)
_ROW_MEMO: dict | None = None


@contextlib.contextmanager
def remember_row_facts():
    """Within: a graph planned again (another candidate of a search) reuses its row facts.
    Only where no graph is changed in place meanwhile.

        >>> with remember_row_facts():
        ...     pass
    """
    global _ROW_MEMO
    outer, _ROW_MEMO = _ROW_MEMO, ({} if _ROW_MEMO is None else _ROW_MEMO)
    try:
        yield
    finally:
        _ROW_MEMO = outer


def propagate(captured, policy: Policy, *, batch_size: int = 8, seq_len: int = 128,
              gather_outputs: bool = True, dropout: str = "sharded", pinned: dict | None = None,
              frozen: frozenset[str] | None = None) -> ShardingPlan:
    """Plan ``captured`` (from :func:`~autoshard.passes.capture.capture`) under ``policy``.
    ``dropout`` says how train-mode dropout draws its masks (:class:`~autoshard.ir.kernels.Dropout`).
    ``pinned`` (parameter name -> ShardSpec) fixes layouts before any use, as a tied
    weight's first use fixes it for the next: another graph of a model whose parameters
    are already sliced (a generation step) plans around the slices it is given.
    ``frozen``: names of the parameters that are constants for the backward (the model's
    ``requires_grad=False`` ones; default: those of ``captured.module``): no gradient
    collective and no gradient sync is planned for them."""
    return _Engine(captured, policy, batch_size=batch_size, seq_len=seq_len, gather_outputs=gather_outputs,
                   dropout=check_dropout_mode(dropout), pinned=pinned, frozen=frozen).run()
