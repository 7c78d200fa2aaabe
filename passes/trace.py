"""The activation-trace pass: what each node saves for backward on one rank.

Runs after propagation, on the finished plan: executes this rank's forward on
the **meta** device — every ATen op of the captured graph with the plan's local
shapes and patched size arguments, the plan's kernel objects and re-layout steps
as they run (their collectives on shape-only groups,
:func:`autoshard.runtime.collectives.sim_group`, so no process group and no memory) —
and records on each node the tensors autograd saves (:attr:`NodePlan.saved`).
:mod:`autoshard.planning.activations` turns those records into bytes per device.
"""

from __future__ import annotations

import dataclasses
import os
import types

import torch
from torch import fx

from autoshard.runtime import parallel_ops
from autoshard.ir.argpath import apply_patches, get_arg, set_arg
from autoshard.runtime.collectives import sim_group
from autoshard.ir.errors import ShardingError
from autoshard.ir.plan import NodePlan, SavedTensor, ShardingPlan

from .fake_replay import makes_new_tensors
from .walked import evolve

__all__ = ["trace"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SKIP = {aten._assert_tensor_metadata.default, aten._assert_scalar.default,
         aten.sym_constrain_range_for_size.default}
_ROLES = ("q", "k", "v", "mask")
_NO_GRAD_BLOCK = torch.ops.higher_order.wrap_with_set_grad_enabled


def _tensors(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def _sid(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


#: what an ATen op, a plan kernel's or a re-layout step's function did on meta, by the
#: function and its operands' geometry (shape, strides, dtype, requires_grad, which operands
#: share a storage) and its other arguments: its outputs' geometry and which tensors autograd
#: saved (an operand, an output, a new tensor, or one of those saved again). A replay makes
#: the same outputs and saves the same tensors without running the op's Python decomposition
#: or the kernel's fake collectives (docs/design.md, "Pricing the search"). None: not replayable.
_REPLAY: dict = {}
_NO_REPLAY = object()
#: ``AUTOSHARD_TRACE_REPLAY=0`` runs every op (the replay's reference)
_REPLAY_ON = os.environ.get("AUTOSHARD_TRACE_REPLAY", "1").strip().lower() not in ("0", "off", "false", "no")


def _key_of(v, tensors: list, sids: dict):
    if isinstance(v, torch.Tensor):
        tensors.append(v)
        group = sids.setdefault(_sid(v), len(sids))
        return ("T", tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.requires_grad, group)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_key_of(x, tensors, sids) for x in v))
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise TypeError("symbolic")
    hash(v)
    return (type(v).__name__, v)


def _geometry(t: torch.Tensor):
    return tuple(t.shape), t.stride(), t.dtype


def _record(out, inputs: list, pending: list):
    """The :data:`_REPLAY` entry of one run: ``(structure, outputs, saved)``, or ``_NO_REPLAY``
    where a replay could not be told from the run (an output sharing an operand's storage,
    a saved view, a non-tensor output)."""
    outs = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (list, tuple)) else None
    if not outs or not all(isinstance(t, torch.Tensor) for t in outs):
        return _NO_REPLAY
    in_sids = {_sid(t) for t in inputs}
    out_sids = [_sid(t) for t in outs]
    if len(set(out_sids)) != len(outs) or in_sids & set(out_sids):
        return _NO_REPLAY
    geo = []
    for t in outs:
        if t.storage_offset() or t.untyped_storage().nbytes() != \
                torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").untyped_storage().nbytes():
            return _NO_REPLAY
        geo.append((*_geometry(t), t.requires_grad))
    saved, news = [], {}        # news: storage of a new saved tensor -> (its place in saved, the tensor)
    for t in pending:
        i = next((i for i, x in enumerate(inputs) if x is t), None)
        j = next((j for j, x in enumerate(outs) if x is t), None)
        if i is not None:
            saved.append(("in", i))
        elif j is not None:
            saved.append(("out", j))
        elif _sid(t) in news:       # saved again (a kernel's backward reads it twice): one tensor, one key
            k, first = news[_sid(t)]
            if first is not t:
                return _NO_REPLAY
            saved.append(("again", k))
        elif _sid(t) in in_sids or _sid(t) in out_sids or t.storage_offset() or t.untyped_storage().nbytes() != \
                torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").untyped_storage().nbytes():
            return _NO_REPLAY
        else:
            news[_sid(t)] = (len(saved), t)
            saved.append(("new", _geometry(t)))
    if not (isinstance(out, torch.Tensor) or type(out) in (list, tuple)):
        return _NO_REPLAY
    return (None if isinstance(out, torch.Tensor) else type(out), tuple(geo), tuple(saved))


def _empty(outs) -> tuple:
    return tuple(torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype, _ in outs)


class _Made(torch.autograd.Function):
    """A replayed op's outputs, made new on meta with an autograd history where the op's
    own had one: an output that requires grad is a non-leaf, as the op's is. A leaf would
    make the next in-place op on it fail (``div_`` of Mixtral's router weights: "a leaf
    Variable that requires grad is being used in an in-place operation"), so a replay would
    note a failure that running the op does not, and the second plan of a model in one
    process (the replay table filled by the first) would differ from the first."""

    @staticmethod
    def forward(ctx, anchor, outs):
        made = _empty(outs)
        ctx.mark_non_differentiable(*(t for t, (*_, grad) in zip(made, outs) if not grad))
        return made

    @staticmethod
    def backward(ctx, *grads):
        return None, None


#: the input that gives :class:`_Made` an autograd history (it saves nothing, reads nothing)
_ANCHOR = torch.empty((), device="meta", requires_grad=True)


class _Trace:
    def __init__(self, plan: ShardingPlan, gm: fx.GraphModule, local_shape):
        self.plan, self.gm, self.local_shape = plan, gm, local_shape
        self.mesh = plan.mesh
        self.balanced = plan.mesh.cp > 1 and plan.cp_order == "balanced"
        self.by_name = {n.name: n for n in plan.nodes}
        self.params = {}
        for p in plan.params:
            for n in (p.name, *p.aliases):
                self.params[n] = p
        self.env: dict = {}
        self.keys: dict[int, str] = {}        # storage id -> key
        self.param_storages: set[int] = set()
        self.alive: list = []                 # every traced tensor stays alive: storage ids stay unique
        self.pending: list = []
        self.muted = False
        self.shared: dict = {}                # (value, steps) -> re-layout result
        self.saved: dict[str, list[SavedTensor]] = {}
        self.failed: dict[str, str] = {}
        self.mismatch: dict[str, tuple] = {}  # node -> (local shape it produced, the plan's)
        self.misfit: dict[str, str] = {}      # reshape -> its error: local sizes that do not fit its input

    # ---- helpers
    def _group(self, axes) -> str:
        axes = tuple(axes)
        return sim_group(self.mesh.size(axes), balanced=axes == ("cp",) and self.balanced)

    def _register(self, t: torch.Tensor, key: str) -> str:
        sid = _sid(t)
        if sid not in self.keys:
            self.keys[sid] = key
            self.alive.append(t)
        return self.keys[sid]

    def _register_out(self, name: str, out) -> None:
        ts = _tensors(out)
        for i, t in enumerate(ts):
            self._register(t, name if len(ts) == 1 or i == 0 else f"{name}:{i}")

    def _steps(self, x, steps, key: str):
        for st in steps:
            x = self._replayed(parallel_ops.step, (x, st.op, self._group(st.axes) if st.axes else None, st.dim,
                                                   st.segments, st.factor), {})
            key = f"{key}>{st}"
            self._register(x, key)
        return x

    def _pack(self, t):
        if not self.muted:
            self.pending.append(t)
        return t

    def _fresh(self, node: fx.Node, inputs):
        """A stand-in output for a node that did not run on meta: the plan's local
        shape, differentiable if an input is; it saves nothing."""
        shapes = self.local_shape(node)
        v = node.meta.get("val")
        grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)

        def one(t, shape):
            if not isinstance(t, torch.Tensor):
                return t
            x = torch.empty(shape if shape is not None else (), dtype=t.dtype, device="meta")
            return x.requires_grad_() if grad and x.is_floating_point() else x

        if isinstance(v, (list, tuple)):
            shapes = shapes if isinstance(shapes, tuple) else (None,) * len(v)
            return type(v)(one(t, s) for t, s in zip(v, shapes))
        return one(v, shapes)

    def _meta(self, a):
        if isinstance(a, fx.Node):
            return self.env[a.name]
        if isinstance(a, torch.device):
            return torch.device("meta")
        return a

    # ---- nodes
    def placeholder(self, node: fx.Node) -> None:
        v = node.meta.get("val")
        if not isinstance(v, torch.Tensor):
            self.env[node.name] = v
            return
        np_ = self.by_name.get(node.name)
        shape = list(self.local_shape(node))
        post = np_.post if np_ is not None else ()
        for st in post:                       # the batch input arrives whole over the axes it is scattered on
            if st.op == "scatter":
                shape[st.dim] *= self.mesh.size(st.axes)
        x = torch.empty(shape, dtype=v.dtype, device="meta")
        self._register(x, node.name)
        self.env[node.name] = self._steps(x, post, node.name) if post else x

    def get_attr(self, node: fx.Node) -> None:
        obj = self.gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        pp = self.params.get(node.target)
        if pp is not None:
            t = torch.empty(pp.local_shape(self.mesh), dtype=obj.dtype, device="meta")
            t.requires_grad_(pp.trainable and t.is_floating_point())
            self.param_storages.add(_sid(t))
            self.alive.append(t)
            self.env[node.name] = t
        elif isinstance(obj, torch.Tensor):
            t = torch.empty(self.local_shape(node) or tuple(obj.shape), dtype=obj.dtype, device="meta")
            self._register(t, node.name)
            self.env[node.name] = t
        else:
            self.env[node.name] = obj

    def call(self, node: fx.Node) -> None:
        if node.target in _SKIP:
            self.env[node.name] = None
            return
        np_ = self.by_name.get(node.name)
        call = types.SimpleNamespace(target=node.target, args=fx.node.map_aggregate(node.args, self._meta),
                                     kwargs=dict(fx.node.map_aggregate(node.kwargs, self._meta)))
        self.pending = []
        inputs = _tensors(list(call.args) + list(call.kwargs.values()))
        grad = torch.is_grad_enabled()
        try:
            if node.target is _NO_GRAD_BLOCK and call.args and call.args[0] is False:
                out = self._fresh(node, ())           # a no-grad region saves nothing
            else:
                out = self._run(node, np_, call)
        except Exception as e:  # noqa: BLE001 - an op meta cannot run: count nothing for it, go on
            self.failed[node.name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if node.target in _RESHAPES and "is invalid for input of size" in str(e) and \
                    not any(a.name in self.failed for a in node.all_input_nodes):
                # meta runs any reshape whose sizes fit: from inputs that ran, the plan's
                # sizes (a patched or sym_size-read one) disagree with its local input
                self.misfit[node.name] = self.failed[node.name]
            self.muted = False
            out = self._fresh(node, inputs)
            self.pending = []
        finally:
            torch.set_grad_enabled(grad)
        if node.name not in self.failed and not (np_ is not None and np_.post):
            self._check_shape(node, out)
        self._register_out(node.name, out)
        if np_ is not None and np_.post:
            out = self._steps(out, np_.post, node.name)
        rec = []
        for j, t in enumerate(self.pending):
            sid = _sid(t)
            if sid in self.param_storages:
                continue
            key = self._register(t, f"{node.name}#{j}")
            rec.append(SavedTensor(key=key, nbytes=t.untyped_storage().nbytes(), dtype=_dtype(t),
                                   shape=tuple(t.shape)))
        if rec:
            self.saved.setdefault(node.name, []).extend(rec)
        self.pending = []
        self.env[node.name] = out

    def _run(self, node: fx.Node, np_: NodePlan | None, call):
        if np_ is not None:
            for path, steps in np_.arg_steps:
                src = get_arg(node, path)
                k = (src.name, tuple(steps))
                if k not in self.shared:
                    self.shared[k] = self._steps(self.env[src.name], steps, src.name)
                set_arg(call, path, self.shared[k])
            apply_patches(call, np_.patches)
            if np_.kernel:
                fn, args, kwargs = parallel_ops.bind(np_.kernel, call, self._group, lambda axes: self.mesh.size(tuple(axes)))
                return self._replayed(fn, args, kwargs)
        if node.target is _SDPA:
            return self._attention(node, call)
        return self._call_op(node.target, call)

    def _call_op(self, target, call):
        """``target(*args, **kwargs)`` on meta, replayed from :data:`_REPLAY` when an op
        with the same target and operand geometry ran before (in this trace or another)."""
        if not makes_new_tensors(target):      # no view or in-place output
            return target(*call.args, **call.kwargs)
        return self._replayed(target, call.args, call.kwargs)

    def _replayed(self, fn, args, kwargs):
        """``fn(*args, **kwargs)`` on meta (an ATen op, a plan kernel's or a re-layout step's
        function), replayed from :data:`_REPLAY` when the same function ran before on operands
        of the same geometry with the same other arguments; :func:`_record` refuses to record
        a run whose outputs a replay could not make (a view of an operand, an in-place result)."""
        if not _REPLAY_ON:
            return fn(*args, **kwargs)
        inputs, sids = [], {}
        try:
            key = (fn, torch.is_grad_enabled(), self.muted, _key_of(args, inputs, sids),
                   _key_of(tuple(sorted(kwargs.items())), inputs, sids))
        except TypeError:
            return fn(*args, **kwargs)
        rec = _REPLAY.get(key)
        if rec is _NO_REPLAY:
            return fn(*args, **kwargs)
        if rec is not None:
            return self._replay(rec, inputs)
        start = len(self.pending)
        out = fn(*args, **kwargs)
        _REPLAY[key] = _record(out, inputs, self.pending[start:])
        return out

    def _replay(self, rec, inputs):
        structure, outs, saved = rec
        made = list(_Made.apply(_ANCHOR, outs) if any(g for *_, g in outs) else _empty(outs))
        kept = []
        with torch.no_grad():
            for kind, x in saved:
                t = inputs[x] if kind == "in" else made[x] if kind == "out" else kept[x] if kind == "again" else \
                    torch.empty_strided(x[0], x[1], dtype=x[2], device="meta")
                kept.append(t)
                if not self.muted:
                    self.pending.append(t)
        return made[0] if structure is None else structure(made)

    def _check_shape(self, node: fx.Node, out) -> None:
        """The op's real local output against the plan's: a difference is a wrong rule
        (the run would fail or, worse, compute on the wrong block)."""
        want = self.local_shape(node)
        got = _tensors(out)
        if want is None or not got:
            return
        wants = list(want) if isinstance(node.meta.get("val"), (list, tuple)) else [want]
        for g, w in zip(got, wants):
            if w is not None and tuple(g.shape) != tuple(w):
                self.mismatch.setdefault(node.name, (tuple(g.shape), tuple(w)))
                return

    def _attention(self, node: fx.Node, call):
        """Run the op unrecorded (meta has only its math path); record the operands
        the backend rule reads (:func:`attention_saved`)."""
        a = list(call.args) + [None] * 4
        ops = dict(zip(_ROLES, a[:4]))
        if ops["mask"] is None:
            ops["mask"] = call.kwargs.get("attn_mask")
        self.muted = True
        try:
            out = self._call_op(node.target, call)
            if out.dim() == 4:       # the fused kernels return [b, h, s, d] laid out as [b, s, h, d]
                out = out.transpose(1, 2).contiguous().transpose(1, 2)
        finally:
            self.muted = False
        if not out.requires_grad:
            return out
        self._register_out(node.name, out)
        rec = []
        for role, t in list(ops.items()) + [("out", out)]:
            if isinstance(t, torch.Tensor):
                key = self._register(t, f"{node.name}#{role}")
                rec.append(SavedTensor(key=key, nbytes=t.untyped_storage().nbytes(), dtype=_dtype(t),
                                       shape=tuple(t.shape), role=role))
        self.saved.setdefault(node.name, []).extend(rec)
        return out

    def run(self) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        with torch.enable_grad(), hooks:
            for node in self.gm.graph.nodes:
                if node.op == "placeholder":
                    self.placeholder(node)
                elif node.op == "get_attr":
                    self.get_attr(node)
                elif node.op == "call_function":
                    self.call(node)
                elif node.op == "call_module":
                    self.env[node.name] = None


def trace(plan: ShardingPlan, gm: fx.GraphModule) -> ShardingPlan:
    """``plan`` with :attr:`NodePlan.saved` filled in by running this rank's forward
    on meta (see the module docstring). ``gm`` is the captured graph the plan was
    made from; the plan's ``local_shapes`` (made by propagation) give the local
    shape of inputs, constants and ops that cannot run on meta (those save nothing
    here and get a note). Tensors saved by a graph node without a row in the plan
    are recorded on the next row. A plan without ``local_shapes`` (read back from
    JSON) is returned as it is.
    """
    if plan.local_shapes is None:
        return plan
    shapes = plan.local_shapes
    t = _Trace(plan, gm, lambda node: shapes.get(node.name))
    t.run()
    if t.misfit:
        first = next(n for n in gm.graph.nodes if n.name in t.misfit)
        inputs = {a.name: shapes.get(a.name) for a in first.all_input_nodes}
        raise ShardingError(f"the plan is inconsistent at this node: run with the plan's local inputs {inputs} its "
                            f"sizes do not fit ({t.misfit[first.name]}); a size the plan reads or patches is not "
                            f"the local one, so autoshard refuses the plan rather than fail at run time", node=first)
    if t.mismatch:
        first = next(n for n in gm.graph.nodes if n.name in t.mismatch)
        got, want = t.mismatch[first.name]
        inputs = {a.name: shapes.get(a.name) for a in first.all_input_nodes}
        raise ShardingError(f"the plan is inconsistent at this node: run with the plan's local inputs {inputs} it "
                            f"produces {list(got)}, the plan expects {list(want)} ({len(t.mismatch)} node(s) differ); "
                            f"a rule chose a layout its op does not compute, so autoshard refuses the plan rather "
                            f"than run it wrong", node=first)
    nodes = list(plan.nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    carry: list[SavedTensor] = []
    saved: dict[int, list[SavedTensor]] = {}
    for node in gm.graph.nodes:
        carry += t.saved.get(node.name, [])
        if node.name in index and (carry or node.name in t.failed):
            saved.setdefault(index[node.name], []).extend(carry)
            carry = []
    if carry and nodes:
        saved.setdefault(len(nodes) - 1, []).extend(carry)
    for i, n in enumerate(nodes):
        note = (f"activation trace: did not run on meta ({t.failed[n.name]}); its saved tensors are not counted",) \
            if n.name in t.failed else ()
        nodes[i] = evolve(n, saved=tuple(saved.get(i, ())), notes=n.notes + note)
    return dataclasses.replace(plan, nodes=tuple(nodes))


