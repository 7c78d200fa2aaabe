"""Activation memory: the bytes one rank keeps for backward, predicted from the plan.

What is predicted is what ``torch.autograd.graph.saved_tensors_hooks`` sees during
one forward of the rank's rewritten module: every tensor autograd saves for
backward, counted once per storage (a view saved by two ops costs its base once),
parameters excluded. That is the activation memory alive at the end of the
forward, the peak before backward starts freeing it (without activation
checkpointing: ``shard(..., activation_checkpointing=True)`` keeps less).

Two halves:

* :func:`autoshard.passes.trace.trace` (its own pass, run on the finished plan) executes this rank's
  forward on the **meta** device: every ATen op of the captured graph with the
  plan's local shapes and patched size arguments, the plan's kernels and
  re-layout steps as they run (their collectives on shape-only groups,
  :func:`autoshard.runtime.collectives.sim_group`, so no process group and no memory).
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

import math

import torch

from ..ir.plan import NodePlan, ShardingPlan

__all__ = ["saved_bytes", "attention_saved", "SavedBytes"]


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
