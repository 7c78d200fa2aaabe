"""Activation memory: the bytes one rank keeps for backward, predicted from the plan.

What is predicted is what ``torch.autograd.graph.saved_tensors_hooks`` sees during
one forward of the rank's rewritten module: every tensor autograd saves for
backward, counted once per storage (a view saved by two ops costs its base once),
parameters excluded. That is the activation memory alive at the end of the
forward, the peak before backward starts freeing it (without activation
checkpointing: ``shard(..., activation_checkpointing=True)`` keeps less).

Two halves:

* :func:`trace` (run by the propagation pass, once per plan) executes this rank's
  forward on the **meta** device: every ATen op of the captured graph with the
  plan's local shapes and patched size arguments, the plan's kernels and
  re-layout steps as they run (their collectives on shape-only groups,
  :func:`autoshard.collectives.sim_group`, so no process group and no memory).
  Autograd's pack hook reports what each op saves; each saved tensor is mapped
  back to the storage it lives in and recorded on the node that saved it
  (:attr:`NodePlan.saved`, plain data, kept in the plan's JSON). Nothing is
  looked up by op: an op saves on meta what it saves on a real device because
  both run the same autograd formula.
* :func:`saved_bytes` sums the distinct storages. The exception is the fused
  attention op ``aten.scaled_dot_product_attention``: its backend kernel, chosen
  at run time by the device, decides what it saves (on meta it would run the
  unfused math path). Its operands are recorded with roles (``q``, ``k``, ``v``,
  ``mask``, ``out``) and :func:`attention_saved` applies the rule of the target
  device (the cluster's ``device``). Its output is traced in the fused kernels'
  layout (``[b, h, s, d]`` stored as ``[b, s, h, d]``, CPU and CUDA alike), so a
  later transpose back to ``[b, s, h·d]`` is a view, as on the device:

  - ``cpu`` (the fused CPU kernel, measured on torch 2.13): q, k, v, the output,
    the log-sum-exp ``[b, h, s_q]`` in fp32, and a boolean mask converted to q's
    dtype at the mask's (broadcast) shape; a float mask is saved as given.
  - ``cuda``: without a mask and in fp16 / bf16 the flash kernel: q, k, v, output
    and the ``[b, h, s_q]`` fp32 log-sum-exp. Otherwise the memory-efficient
    kernel: the same with the log-sum-exp padded to a multiple of 32 queries and
    the mask (boolean converted to q's dtype) with its last dim padded to a
    multiple of 16. (From PyTorch's kernels; not measured here. The few bytes of
    RNG state are ignored.)

Example: a one-layer Llama, batch 4 × seq 16, fp32, on one rank:

    >>> from transformers import LlamaConfig
    >>> import autoshard
    >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    ...                   num_attention_heads=4, num_key_value_heads=4, vocab_size=128)
    >>> p = autoshard.plan(cfg, world_size=1, mode="1d", batch_size=4, seq_len=16)
    >>> attn = next(n for n in p.nodes if n.op == "scaled_dot_product_attention")
    >>> sorted(s.role for s in attn.saved)
    ['k', 'mask', 'out', 'q', 'v']
    >>> [(k.split("#")[-1], b) for k, b in attention_saved(attn, "cpu")]     # q, k, v, out [4, 4, 16, 16]
    [('add_5', 16384), ('add_6', 16384), ('linear_2', 16384), ('scaled_dot_product_attention', 16384), ('lse', 1024), ('mask', 4096)]
    >>> saved_bytes(p, "cpu") - saved_bytes(p, "cuda")     # CUDA pads the log-sum-exp to 32 queries
    -1024
"""

from __future__ import annotations

import dataclasses
import math
import operator
import types

import torch
from torch import fx

from . import kernels as K
from .collectives import sim_group
from .plan import NodePlan, SavedTensor, ShardingPlan

__all__ = ["trace", "saved_bytes", "attention_saved", "SavedBytes"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_SKIP = {aten._assert_tensor_metadata.default, aten._assert_scalar.default,
         aten.sym_constrain_range_for_size.default}
_ROLES = ("q", "k", "v", "mask")
_NO_GRAD_BLOCK = torch.ops.higher_order.wrap_with_set_grad_enabled


# ------------------------------------------------------------------------- trace

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


class _Trace:
    def __init__(self, plan: ShardingPlan, gm: fx.GraphModule, local_shape):
        self.plan, self.gm, self.local_shape = plan, gm, local_shape
        self.mesh = plan.mesh
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

    # ---- helpers
    def _group(self, axes) -> str:
        return sim_group(self.mesh.size(tuple(axes)))

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
            x = K.step(x, st.op, self._group(st.axes) if st.axes else None, st.dim, st.segments, st.factor)
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
            t.requires_grad_(bool(obj.requires_grad) and t.is_floating_point())
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
            self.muted = False
            out = self._fresh(node, inputs)
            self.pending = []
        finally:
            torch.set_grad_enabled(grad)
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
        from autoshard.passes.rewrite import _get, _set, apply_patches, kernel_call

        if np_ is not None:
            for path, steps in np_.arg_steps:
                src = _get(node, path)
                k = (src.name, tuple(steps))
                if k not in self.shared:
                    self.shared[k] = self._steps(self.env[src.name], steps, src.name)
                _set(call, path, self.shared[k])
            apply_patches(call, np_.patches)
            if np_.kernel:
                fn, args, kwargs = kernel_call(call, np_, self._group, lambda axes: self.mesh.size(tuple(axes)))
                return fn(*args, **kwargs)
        if node.target is _SDPA:
            return self._attention(node, call)
        return node.target(*call.args, **call.kwargs)

    def _attention(self, node: fx.Node, call):
        """Run the op unrecorded (meta has only its math path); record the operands
        the backend rule reads (:func:`attention_saved`)."""
        a = list(call.args) + [None] * 4
        ops = dict(zip(_ROLES, a[:4]))
        if ops["mask"] is None:
            ops["mask"] = call.kwargs.get("attn_mask")
        self.muted = True
        try:
            out = node.target(*call.args, **call.kwargs)
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


def trace(plan: ShardingPlan, gm: fx.GraphModule, local_shape) -> ShardingPlan:
    """``plan`` with :attr:`NodePlan.saved` filled in by running this rank's forward
    on meta (see the module docstring). ``gm`` is the captured graph the plan was
    made from; ``local_shape(node)`` gives a graph value's local shape under the
    plan (a tuple of shapes for a multi-output node), for inputs, constants and
    ops that cannot run on meta (those save nothing here and get a note).
    Tensors saved by a graph node without a row in the plan are recorded on the
    next row."""
    t = _Trace(plan, gm, local_shape)
    t.run()
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
        nodes[i] = dataclasses.replace(n, saved=tuple(saved.get(i, ())), notes=n.notes + note)
    return dataclasses.replace(plan, nodes=tuple(nodes))


# ------------------------------------------------------------------------ predict

_ITEM = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
         "int8": 1, "uint8": 1, "bool": 1}


def _item(dtype: str) -> int:
    return _ITEM.get(dtype) or torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _repriced(dtype_bytes: int | None):
    def price(nbytes: int, dtype: str) -> int:
        if dtype_bytes is None or not dtype.startswith(("float", "bfloat")):
            return nbytes
        return nbytes * dtype_bytes // _item(dtype)
    return price


def attention_saved(node: NodePlan, device: str = "cuda", *, dtype_bytes: int | None = None) -> list[tuple[str, int]]:
    """``(storage key, bytes)`` a fused attention node saves on ``device`` (``"cpu"``
    or ``"cuda"``), from the operands recorded with roles (module docstring);
    ``dtype_bytes`` as in :func:`saved_bytes` (the log-sum-exp stays fp32)."""
    ops = {s.role: s for s in node.saved or () if s.role}
    if not ops:
        return []
    price = _repriced(dtype_bytes)
    q = ops["q"]
    b_h_s = math.prod(q.shape[:-1])
    out = [(ops[r].key, price(ops[r].nbytes, ops[r].dtype)) for r in ("q", "k", "v", "out") if r in ops]
    m = ops.get("mask")
    qi = price(_item(q.dtype), q.dtype)
    if device == "cpu":
        out.append((f"{node.name}#lse", b_h_s * 4))
        if m is not None:
            out.append((f"{node.name}#mask", math.prod(m.shape) * qi) if m.dtype == "bool"
                       else (m.key, price(m.nbytes, m.dtype)))
        return out
    if m is None and (dtype_bytes or _item(q.dtype)) == 2:
        out.append((f"{node.name}#lse", b_h_s * 4))            # flash
        return out
    s_q = q.shape[-2]
    out.append((f"{node.name}#lse", b_h_s // s_q * (-(-s_q // 32) * 32) * 4))   # memory-efficient
    if m is not None:
        if m.dtype == "bool" or m.shape[-1] % 16:
            out.append((f"{node.name}#mask", math.prod(m.shape[:-1]) * (-(-m.shape[-1] // 16) * 16) * qi))
        else:
            out.append((m.key, price(m.nbytes, m.dtype)))
    return out


def saved_bytes(plan: ShardingPlan, device: str = "cuda", *, dtype_bytes: int | None = None) -> int | None:
    """Bytes one rank saves for backward under ``plan`` on ``device`` (``"cpu"`` /
    ``"cuda"``): the distinct storages of every node's :attr:`NodePlan.saved`,
    fused attention by :func:`attention_saved`. ``dtype_bytes`` re-prices the
    floating-point storages at that element size (e.g. 2 for a bf16 run of a plan
    traced in fp32). ``None`` if the plan was not traced (built by hand, or read
    from JSON written before tracing existed)."""
    if all(n.saved is None for n in plan.nodes):
        return None
    price = _repriced(dtype_bytes)
    seen: dict[str, int] = {}
    for n in plan.nodes:
        for s in n.saved or ():
            if not s.role:
                seen[s.key] = price(s.nbytes, s.dtype)
        for key, b in attention_saved(n, device, dtype_bytes=dtype_bytes):
            seen.setdefault(key, b)
    return int(sum(seen.values()))


# ------------------------------------------------------------------------ measure

class SavedBytes:
    """What :func:`saved_bytes` predicts, measured: the bytes of the distinct storages
    autograd saves for backward while the context is active, storages of ``params``
    excluded::

        with SavedBytes(sharded.parameters()) as m:
            loss = sharded(**inputs).loss
        m.nbytes
    """

    def __init__(self, params=()):
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._saved: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self._params:
            self._saved[st.data_ptr()] = st.nbytes()
        return t

    @property
    def nbytes(self) -> int:
        return sum(self._saved.values())

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
