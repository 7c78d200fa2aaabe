"""Give every graph value a ShardSpec and produce the :class:`ShardingPlan`.

The walk: visit the captured graph in order, ask the rule for each node (heavy ops,
linear and embedding, go to the mode's policy; everything else to the shared rules in
:mod:`autoshard.policies.generic`), record the choice and the layout of its output.
What follows from the recorded choices are passes over the walk's result
(:class:`~autoshard.passes.walked.Walked`; docs/design.md, "The propagation passes"):
the re-layout steps (:mod:`.layouts`), the gradient invariant's steps and syncs
(:mod:`.grad_needs`), the collectives, bytes and FLOPs, and the plan's rows
(:mod:`.count`).

A walk that finds a Linear whose output split a later op cannot take is thrown away
and walked again with that Linear held whole (:class:`_Retry`).

Runs with no process group, on meta weights, for any world size.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import fx

from autoshard.ir.argpath import get_arg
from autoshard.ir.errors import ShardingError
from autoshard.ir.heap import collector_paused
from autoshard.ir.kernels import check_dropout_mode
from autoshard.ir.plan import NodePlan, ParamPlan, ShardingPlan, Step
from autoshard.ir.spec import ShardSpec, replicated
from autoshard.policies.base import Choice, NeedReplicate, Policy, SymbolicSizes
from autoshard.policies.generic import rule_for, writes_first_arg

from .annotate import Annotation, annotate, param_names
from .count import count_comms, plan_rows, state_rows
from .grad_needs import grad_syncs, needs_grad
from .layouts import relayouts
from .row_order import CONFLICT, RowFact, row_facts
from .rule_context import NodeContext, Shapes, is_tensor_val, stop_note
from .walked import Visit, Walked

__all__ = ["propagate", "remember_row_facts", "state_inputs"]

aten = torch.ops.aten
_PRIME_BATCH = SymbolicSizes.BATCH
_get = get_arg


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
        if n.op != "placeholder" or not is_tensor_val(n.meta.get("val")) or not uses:
            continue
        if all(writes_first_arg(u.target) and u.args and u.args[0] is n for u in uses):
            out.append(n.name)
    return tuple(out)

def _computed_expert_weight(node: fx.Node) -> str:
    """Why a grouped matmul meets the sorted rows unrecognised, and the valid choices, when
    its weight is computed in the graph rather than read from a parameter (a LoRA adapter on
    the expert weights: peft's ``target_parameters`` adds ``B @ A`` to each expert's weight);
    '' for any other node. Only a grouped matmul whose weight is a parameter (or its
    transpose) is folded into ``grouped_linear`` and runs on the sorted rows (docs/design.md,
    "Expert parallelism")."""
    from autoshard.ir.grouped import grouped_targets

    if node.target not in grouped_targets() or len(node.args) < 2 or not isinstance(node.args[1], fx.Node):
        return ""
    seen, todo, params = set(), [node.args[1]], []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor):
            params.append(n.target)
        todo.extend(n.all_input_nodes)
    return (f"; it is a grouped matmul (the experts' per-expert matmul) whose weight {node.args[1].name} is computed "
            f"in the graph from {', '.join(sorted(params)) or 'other values'} (an adapter on the expert weights, "
            f"e.g. peft's target_parameters), and only a grouped matmul whose weight is a parameter is split with "
            f"its rows. Valid choices: LoRA on the attention and dense layers (peft target_modules) with the "
            f"experts frozen or trained whole, or no batch split (dp=1, cp=1, ep=1)")


@dataclass
class _State:
    """What the walk has decided so far (the rules read it through :class:`NodeContext`)."""

    specs: dict            # node name -> spec | tuple | None
    param_spec: dict       # get_attr target -> ShardSpec (fixed)
    batch_index: set = field(default_factory=set)
    origin: dict = field(default_factory=dict)      # node name -> linear node name whose column split it carries
    cp_pending: set = field(default_factory=set)    # partial lookups the cp split waits behind


def _graph_facts(gm: fx.GraphModule, frozen) -> tuple:
    """What the walk reads of the graph alone, whatever the policy: parameter names, the
    frozen ones (docs/design.md, frozen parameters: by every name of the tensor), state
    inputs, annotations, the values needing a gradient, the largest embedding table.
    Inside :func:`remember_row_facts` (a search planning one graph per candidate) read once
    per graph."""
    key = ("graph", id(gm), None if frozen is None else frozenset(frozen))
    if _ROW_MEMO is not None and key in _ROW_MEMO:
        return _ROW_MEMO[key][1]
    params = param_names(gm)
    frozen_names = frozenset(frozen) if frozen is not None else frozenset(
        n for n, p in gm.named_parameters(remove_duplicate=False) if not p.requires_grad)
    embs = [(n.args[0].meta["val"].numel(), n.args[0].target) for n in gm.graph.nodes
            if n.op == "call_function" and n.target == aten.embedding.default
            and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr"]
    facts = (params, frozen_names, frozenset(state_inputs(gm)), annotate(gm), needs_grad(gm, params, frozen_names),
             max(embs)[1] if embs else None)
    if _ROW_MEMO is not None:
        _ROW_MEMO[key] = (gm, facts)       # the graph kept alive: its id stays its own
    return facts


class _Engine:
    """The walk over one captured graph under one policy (re-walked while a Linear must be held whole)."""

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
        self.params, self.frozen, self.state, self.ann, self.needs_grad, self.largest_embedding = \
            _graph_facts(self.gm, frozen)
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
        self.forced: set[str] = set()
        # Linear -> why a re-plan holds it whole (the op that refused its split), for its note
        self.forced_why: dict[str, str] = {}

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
        walked = self._walk()
        walked = count_comms(grad_syncs(relayouts(walked)))
        rows = state_rows(walked) + plan_rows(walked)
        local = {n.name: self._local_shape(n) for n in self.gm.graph.nodes}
        return ShardingPlan(model=self.cap.model_name, mode=self.policy.name, mesh=self.mesh,
                            tp_axes=self.policy.tp_axes, batch_axes=() if self.static_batch else self.policy.batch_axes,
                            batch_size=self.batch_size, seq_len=self.seq_len, nodes=tuple(rows),
                            params=self._param_plans(walked.param_sync), dp=self.policy.dp,
                            cp_order=self.policy.cp_order, cp_attention=self.policy.cp_attention,
                            local_shapes=local)

    def _walk(self) -> Walked:
        """One walk over the graph: a :class:`Visit` per node given to a rule, in order."""
        self.shapes = Shapes(self.cap.batch_symbol, self.cap.seq_symbol, self.batch_size, self.seq_len,
                             shared=self._shared_shapes())
        self.st = _State({}, dict(self.pinned))
        self.rows = self._row_facts()
        self.st_pending: set[str] = set()       # Linears to replicate in the next pass
        entries = []
        for node in self.gm.graph.nodes:
            e = self._visit(node)
            if e is not None:
                entries.append(e)
        if self.st_pending:
            raise _Retry(self.st_pending)
        if self.cp_axes and not any(isinstance(sp, ShardSpec) and "cp" in sp.axes for sp in self.st.specs.values()):
            raise ShardingError(f"cp={self.mesh.cp}: no value of {self.cap.model_name}'s graph has a "
                                f"sequence dim the context-parallel split can cut (it starts at a token lookup "
                                f"whose rows carry the sequence symbol; this graph has none, e.g. a sequence "
                                f"torch.export made static); valid here: cp=1")
        return Walked(gm=self.gm, policy=self.policy, mesh=self.mesh, shapes=self.shapes, params=self.params,
                      state=self.state, rows=self.rows, batch_axes=self.batch_axes, dp_axes=self.dp_axes,
                      gather_outputs=self.gather_outputs, needs_grad=self.needs_grad, specs=self.st.specs,
                      param_spec=self.st.param_spec, entries=tuple(entries),
                      output=next((n for n in self.gm.graph.nodes if n.op == "output"), None))

    def _param_plans(self, param_sync: dict) -> tuple[ParamPlan, ...]:
        """A row per parameter tensor (tied names as aliases of the one the graph uses)."""
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
            sync = tuple(a for a in self.mesh.axes if a in param_sync.get(name, set()))
            dense = ()
            pads = [x for x in getattr(self.cap, "padding", ()) if name in x.names]
            pad = pads[0] if pads else None       # the width (or vocabulary); a hidden size padded after it: extra
            if pad is not None:
                sizes = {x.dim: x.dense for x in pads}
                dense = tuple(sizes.get(d, s) for d, s in enumerate(p.shape))
            params.append(ParamPlan(name=name, global_shape=tuple(p.shape), spec=spec, grad_sync=sync,
                                    dtype_bytes=p.element_size(), aliases=tuple(n for n in names if n != name),
                                    dense_shape=dense, trainable=not self.frozen & set(names),
                                    pad_segments=getattr(pad, "segments", 1), pad_copies=getattr(pad, "copies", 0),
                                    pad_unit=getattr(pad, "unit", 0), pad_extra=tuple(x.dim for x in pads[1:])))
        return tuple(params)

    def _shared_shapes(self) -> dict | None:
        """The shapes :class:`Shapes` shares between walks of this graph at these sizes inside
        :func:`remember_row_facts` (a search planning one graph per candidate); None outside."""
        if _ROW_MEMO is None:
            return None
        key = ("shapes", id(self.gm), self.cap.batch_symbol, self.cap.seq_symbol, self.batch_size, self.seq_len)
        if key not in _ROW_MEMO:
            _ROW_MEMO[key] = (self.gm, {})          # the graph kept alive: its id stays its own
        return _ROW_MEMO[key][1]

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
                next(sh.extra)
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
            if not is_tensor_val(t):
                return None
            g = self.shapes.concrete_val(t)
            return sp.local_shape(g, self.mesh) if isinstance(sp, ShardSpec) else g

        if isinstance(v, (list, tuple)):
            return tuple(one(t, spec[i] if isinstance(spec, tuple) and i < len(spec) else None)
                         for i, t in enumerate(v))
        return one(v, spec)

    # ------------------------------------------------------------- per node
    def _visit(self, node: fx.Node) -> Visit | NodePlan | None:
        ann = self.ann.get(node.name, Annotation("other", ""))
        if node.op == "placeholder":
            return self._placeholder(node, ann)
        if node.op == "get_attr":
            v = node.meta.get("val")
            if node.target not in self.params:
                self.st.specs[node.name] = replicated(v.dim()) if is_tensor_val(v) else None
            return None
        if node.op == "output":
            return None         # its gathers: a pass after the walk (.layouts)
        if node.op == "call_module":
            self.st.specs[node.name] = None
            return None
        ctx = NodeContext(self, node)
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
        if not isinstance(out, ShardSpec) or not is_tensor_val(node.meta.get("val")):
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
                                f"be a block of the dense one{_computed_expert_weight(node)}", node=node)

    def _placeholder(self, node, ann) -> NodePlan | None:
        v = node.meta.get("val")
        if node.name in self.state:         # laid out by its first write (index_copy rule)
            return None
        if not is_tensor_val(v):
            self.st.specs[node.name] = None
            return None
        sh = self.shapes.probe_val(v)
        b = self.policy.batch_axes
        if self.batch_axes and sh and sh[0] == _PRIME_BATCH:
            spec = replicated(len(sh)).with_dim(0, self.batch_axes)
            self.st.specs[node.name] = spec
            if not b:
                return None
            return NodePlan(name=node.name, op="placeholder", kind="input", module="", out_spec=spec,
                            post=(Step(op="scatter", axes=b, dim=0),), global_shape=self.shapes.concrete_val(v),
                            local_shape=spec.local_shape(self.shapes.concrete_val(v), self.mesh),
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
                                                   f"{stop_note(node, nr.reason)}")
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

    def _apply(self, node, ann, ctx, choice: Choice) -> Visit:
        """Record ``choice`` for ``node``: the layouts it asks of its inputs (a parameter's
        and a state input's fixed here), its output's layout."""
        in_specs, moves = self._bind_inputs(node, ctx, choice)
        out = choice.out
        self.st.specs[node.name] = out
        self._track_batch_index(node, out)
        self._track_origin(node, ann, choice, in_specs)
        return Visit(node=node, ann=ann, choice=choice, in_specs=in_specs, moves=moves,
                     row=not (out is None and not choice.kernel))

    def _bind_inputs(self, node, ctx, choice: Choice) -> tuple[dict, tuple]:
        """(spec per input path, the paths re-laid from their own layout) for the layouts
        the choice asks of ``node``'s inputs: a parameter's layout is fixed by its first
        use, a free state input takes the one asked, any other value is re-laid
        (:mod:`.layouts`)."""
        in_specs = {}
        moves = []
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
                moves.append(path)
        return in_specs, tuple(moves)

    def _bind_param(self, node, a: fx.Node, req: ShardSpec) -> None:
        """Fix parameter ``a``'s layout at its first use; a later use must ask the same."""
        fixed = self.st.param_spec.get(a.target)
        if fixed is None:
            self.st.param_spec[a.target] = req
        elif fixed != req:
            raise ShardingError(f"parameter {a.target} is already split as {fixed} by an earlier use; "
                                f"this use needs {req}", node=node)

    def _track_batch_index(self, node, out) -> None:
        """Remember values that index the rank's own batch rows (a split ``arange`` and
        what reshapes or offsets it)."""
        if node.target == aten.arange.default and isinstance(out, ShardSpec) and out.ndim == 1 and out.dims[0]:
            self.st.batch_index.add(node.name)
        if node.target in (aten.unsqueeze.default, aten.view.default, aten.expand.default, aten.add.Tensor) and \
                any(isinstance(a, fx.Node) and a.name in self.st.batch_index for a in node.args):
            self.st.batch_index.add(node.name)

    def _track_origin(self, node, ann, choice, in_specs):
        if ann.kind == "linear" and not choice.kernel and isinstance(choice.out, ShardSpec) and choice.out.dims[-1]:
            self.st.origin[node.name] = node.name
            return
        for a in node.all_input_nodes:
            o = self.st.origin.get(a.name)
            if o and ann.kind not in ("linear", "norm", "attention", "loss"):
                self.st.origin[node.name] = o
                return


class _Retry(Exception):
    def __init__(self, linears: set[str]):
        self.linears = set(linears)


#: graph -> its row facts and its graph facts (:func:`_graph_facts`), while
#: :func:`remember_row_facts` is open (None: not remembered)
_ROW_MEMO: dict | None = None


@contextlib.contextmanager
def remember_row_facts():
    """Within: a graph planned again (another candidate of a search) reuses its row facts
    and what the walk reads of the graph alone (annotations, gradient needs), and the
    cyclic garbage collector pauses (:func:`gc.disable`; re-enabled on exit unless it was
    off). Only where no graph is changed in place meanwhile.

        >>> with remember_row_facts():
        ...     pass
    """
    global _ROW_MEMO
    outer, _ROW_MEMO = _ROW_MEMO, ({} if _ROW_MEMO is None else _ROW_MEMO)
    # no cyclic collection meanwhile: the walks allocate millions of small objects, so the
    # collector ran its full scans of the heap (torch, the captured graphs: ~500k objects)
    # every few candidates, as long as the walks themselves (7B@64: 0.6 s of 2.4)
    try:
        with collector_paused():
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
