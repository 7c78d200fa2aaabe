"""Capture a few layers, stamp the rest: the graph of a deep model from a shallow export.

``torch.export`` of a 32-layer model traces 32 identical layers; planning needs only
their graph. :func:`capture_stamped` exports the model with each repeated stack
(every ``ModuleList`` whose length a ``*layer*`` count of the config sets) cut to
``keep`` layers (3), then rebuilds the full graph: the nodes of the last captured
layer ``T`` are copied once per missing layer, their parameters renamed
(``layers.2.`` → ``layers.7.``), their inputs from layer ``T-1`` taken from the copy
before, everything else (the stem's rotary tables and masks, T5's position bias
from layer 0) shared, and the head (or a later stack: BART's decoder reading the
encoder's last layer) re-attached to the last copy. The result is the graph a full
export gives, node by node, except for the names of the copied nodes (export numbers
names with gaps left by nodes it erased while tracing); checked against full exports
of GPT-2, Llama, BERT, T5 and BART in ``tests/passes/test_stamp.py``.

Stamping is refused (:class:`StampRefused`; :func:`capture_stamped` then exports the
whole model) unless it is provably a copy: layers ``T-1`` and ``T`` must have the same ops with inputs in the
same places, per-layer config lists (``layer_types``) must be uniform past layer 0,
the head must read no layer but the last, and the stamped module must hold
exactly the full model's parameter and buffer names and shapes.

    >>> import transformers
    >>> from autoshard.io.builder import model_from
    >>> cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
    ...                                num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    >>> cap = capture_stamped(model_from(cfg).train(), build=model_from)
    >>> cap.stamped, "model.layers.5.mlp.down_proj.weight" in dict(cap.module.named_parameters())
    (True, True)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import torch
from torch import fx, nn

from .annotate import module_path
from .capture import Captured, capture

__all__ = ["capture_stamped", "stamp", "shrink_config", "StampRefused", "KEEP"]

KEEP = 3                    # layers captured per stack: 0 (may differ: T5's bias), T-1 and T (compared)
_SUFFIX = re.compile(r"^(.*?)_(\d+)$")


def _layer_keys(d: dict, counts: set[int]) -> dict[str, int]:
    """The layer counts of a config's dict: int entries named ``*layer*`` equal to a ModuleList's length."""
    return {k: v for k, v in d.items()
            if "layer" in k and isinstance(v, int) and not isinstance(v, bool) and v in counts}


def shrink_config(config, full: nn.Module, keep: int = KEEP):
    """``(config with every stack cut to keep layers, {list prefix: full length})``, or
    ``None`` when the model's layers cannot be shown uniform from the config."""
    lists = {name: len(m) for name, m in full.named_modules() if isinstance(m, nn.ModuleList) and len(m) > keep}
    d = config.to_dict()
    keys = _layer_keys(d, set(lists.values()))
    if not keys:
        return None
    for k, v in d.items():      # per-layer lists (layer_types, ...): uniform past layer 0, then cut
        if isinstance(v, (list, tuple)) and len(v) in set(keys.values()) and len(v) > keep:
            if any(x != v[1] for x in v[1:]):
                return None
            d[k] = type(v)(v[:keep])
    for k in keys:
        d[k] = keep
    d.pop("transformers_version", None)
    small = type(config).from_dict(d)
    for attr in ("_attn_implementation_internal", "_attn_implementation"):
        if hasattr(config, attr):
            try:
                setattr(small, attr, getattr(config, attr))
            except Exception:  # noqa: BLE001 - a read-only property on some versions
                pass
    return small, lists


def _tag(node: fx.Node, prefixes) -> tuple[str, int] | None:
    """``(list prefix, layer index)`` of a node: by its get_attr target or its module path."""
    path = node.target if node.op == "get_attr" else module_path(node) if node.op == "call_function" else ""
    if not isinstance(path, str) or not path:
        return None
    for p in prefixes:
        if path.startswith(p + "."):
            head = path[len(p) + 1:].split(".", 1)[0]
            if head.isdigit():
                return p, int(head)
    return None


def _split_name(name: str) -> tuple[str, int]:
    m = _SUFFIX.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _rename_stack(meta: dict, prefix: str, src: int, dst: int) -> dict:
    meta = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        a, b = f"{prefix}.{src}", f"{prefix}.{dst}"
        ka, kb = a.replace(".", "_"), b.replace(".", "_")
        pat = re.compile(re.escape(a) + r"(?=\.|$)")
        kpat = re.compile(re.escape(ka) + r"(?=_|$)")
        meta["nn_module_stack"] = {kpat.sub(kb, k): (pat.sub(b, v[0]) if isinstance(v[0], str) else v[0], *v[1:])
                                   for k, v in stack.items()}
    return meta


class StampRefused(Exception):
    """The captured layers are not one layer repeated (the message says where)."""


def _same_layer(prev: list[fx.Node], cur: list[fx.Node], prefix: str, t: int, tags: dict) -> None:
    """Check layers ``t-1`` and ``t`` are one layer twice: the same ops in the same order,
    the same constant arguments, each input from the same place (inside the layer at
    the same position, the layer before, or the same outside value)."""
    if len(prev) != len(cur):
        raise StampRefused(f"layers {t - 1} and {t} of {prefix} have {len(prev)} and {len(cur)} nodes")
    pos_prev = {n: i for i, n in enumerate(prev)}
    pos_cur = {n: i for i, n in enumerate(cur)}
    for a, b in zip(prev, cur):
        if a.op != b.op:
            raise StampRefused(f"{a.name} / {b.name}: {a.op} vs {b.op}")
        if a.op == "get_attr":
            if a.target.replace(f"{prefix}.{t - 1}.", f"{prefix}.{t}.", 1) != b.target:
                raise StampRefused(f"{a.target} / {b.target}")
            continue
        if a.target != b.target:
            raise StampRefused(f"{a.name} / {b.name}: {a.target} vs {b.target}")
        fa, fb = [], []
        fx.map_arg((a.args, a.kwargs), lambda x: fa.append(x))
        fx.map_arg((b.args, b.kwargs), lambda x: fb.append(x))
        if len(fa) != len(fb) or repr(_shape_free(a)) != repr(_shape_free(b)):
            raise StampRefused(f"{a.name} / {b.name}: other arguments")
        for x, y in zip(fa, fb):
            if x in pos_prev:
                ok = pos_cur.get(y) == pos_prev[x]
            else:
                ok = x is y or (tags.get(x) == (prefix, t - 2) and tags.get(y) == (prefix, t - 1))
            if not ok:
                raise StampRefused(f"{a.name} / {b.name}: input {x.name} vs {y.name}")


def _shape_free(n: fx.Node):
    """A node's non-node arguments (the structure compared between two layers)."""
    return fx.map_arg((n.args, n.kwargs), lambda x: None)


def stamp(cap: Captured, lists: dict[str, int]) -> Captured:
    """``cap`` (each stack of ``lists`` captured with ``KEEP`` layers) with every stack
    grown to its full length ``lists[prefix]``. Raises ``StampRefused`` when the layers are
    not one layer repeated."""
    gm = cap.module
    nodes = list(gm.graph.nodes)
    t = KEEP - 1
    grow = {p: n for p, n in lists.items() if any(_tag(x, (p,)) == (p, t) for x in nodes)}
    if not grow:
        raise StampRefused("no captured stack to grow")
    tags = {n: _tag(n, tuple(sorted(grow, key=len, reverse=True))) for n in nodes}
    layer = {p: [n for n in nodes if tags[n] == (p, t)] for p in grow}
    before = {p: [n for n in nodes if tags[n] == (p, t - 1)] for p in grow}
    for p in grow:
        _same_layer(before[p], layer[p], p, t, tags)
    prev_of = {p: {a: b for a, b in zip(before[p], layer[p])} for p in grow}   # layer T-1 node -> layer T's
    params = dict(gm.named_parameters(remove_duplicate=False))
    buffers = dict(gm.named_buffers(remove_duplicate=False))
    g = fx.Graph()                             # gm grows in place: the capture is this call's own
    env: dict[fx.Node, fx.Node] = {}
    copy_of: dict[tuple[int, fx.Node], fx.Node] = {}
    closed: set[str] = set()                   # stacks whose layers are all emitted

    def create(n: fx.Node, args, kwargs, name: str, target=None) -> fx.Node:
        r = g.create_node(n.op, n.target if target is None else target, args, kwargs, name, n.type)
        r.meta = dict(n.meta)
        return r

    def add_tensor(target: str, src) -> None:
        mod_path, _, attr = target.rpartition(".")
        owner = gm
        for part in mod_path.split(".") if mod_path else []:
            if part not in owner._modules:
                owner._modules[part] = nn.Module()
            owner = owner._modules[part]
        if isinstance(src, nn.Parameter):
            owner._parameters[attr] = nn.Parameter(torch.empty_like(src, device="meta"),
                                                   requires_grad=src.requires_grad)
        elif isinstance(src, torch.Tensor):
            owner._buffers[attr] = torch.empty_like(src, device="meta")
        else:
            raise StampRefused(f"{target} is not a tensor")

    def emit_copies(p: str, run: list[fx.Node]) -> None:
        for i in range(t + 1, grow[p]):
            def arg(x: fx.Node) -> fx.Node:
                if tags.get(x) == (p, t):
                    if (i, x) not in copy_of:
                        raise StampRefused(f"layer {t} of {p} reads {x.name} before it is made")
                    return copy_of[(i, x)]
                if tags.get(x) == (p, t - 1):       # the layer before: its counterpart in copy i-1
                    tx = prev_of[p][x]
                    return env[tx] if i - 1 == t else copy_of[(i - 1, tx)]
                return outside(x)
            for n in run:
                args, kwargs = fx.map_arg(n.args, arg), fx.map_arg(n.kwargs, arg)
                if n.op == "get_attr":
                    target = n.target.replace(f"{p}.{t}.", f"{p}.{i}.", 1)
                    add_tensor(target, params.get(n.target, buffers.get(n.target)))
                    r = create(n, args, kwargs, target.replace(".", "_"), target)
                else:
                    r = create(n, args, kwargs, _split_name(n.name)[0])
                r.meta = _rename_stack(n.meta, p, t, i)
                copy_of[(i, n)] = r

    def outside(x: fx.Node) -> fx.Node:
        """A value from outside the stack being emitted: a finished stack's template layer
        stands for its last copy (a decoder reading the encoder's last layer, the head)."""
        tx = tags.get(x)
        if tx is not None and tx[0] in closed:
            if tx[1] != t:
                raise StampRefused(f"a node after the layers of {tx[0]} reads its layer {tx[1]} ({x.name})")
            return copy_of[(grow[tx[0]] - 1, x)]
        return env[x]

    k = 0
    while k < len(nodes):
        n = nodes[k]
        tg = tags[n]
        if tg is not None and tg[1] == t:
            p = tg[0]
            j = k
            while j < len(nodes) and tags[nodes[j]] == tg:
                j += 1
            run = nodes[k:j]
            attrs = run[0].op == "get_attr"      # a layer is two runs: its parameters, then its ops
            if any((m.op == "get_attr") != attrs for m in run) or \
                    len(run) != sum(1 for m in layer[p] if (m.op == "get_attr") == attrs):
                raise StampRefused(f"layer {t} of {p} is not one contiguous run of nodes")
            for m in run:
                env[m] = create(m, fx.map_arg(m.args, outside), fx.map_arg(m.kwargs, outside), m.name)
            emit_copies(p, run)
            if not attrs:
                closed.add(p)
            k = j
            continue
        env[n] = create(n, fx.map_arg(n.args, outside), fx.map_arg(n.kwargs, outside), n.name)
        k += 1
    g.lint()
    gm.graph = g
    gm.recompile()
    return dataclasses.replace(cap, module=gm, program=None, stamped=True)


def capture_stamped(full: nn.Module, *, build: Callable, capture_fn: Callable = capture, **kw) -> Captured:
    """The capture of ``full`` (a model on meta), exported with ``KEEP`` layers per stack and
    stamped to its depth; ``capture_fn(full, **kw)`` when stamping is refused. ``build``
    makes the shallow model (on meta) from its config; ``capture_fn`` captures it."""
    config = getattr(full, "config", None)
    on_meta = all(t.device.type == "meta" for t in full.parameters())
    shrunk = shrink_config(config, full) if on_meta and hasattr(config, "to_dict") else None
    if shrunk is not None:
        small_cfg, lists = shrunk
        small = build(small_cfg)
        small.train(full.training)
        try:
            cap = stamp(capture_fn(small, **kw), lists)
            if _tensors(cap.module) == _tensors(full):
                return dataclasses.replace(cap, config=config)
        except StampRefused:        # not one layer repeated: the whole model is exported below
            pass
    return capture_fn(full, **kw)


def _tensors(m: nn.Module) -> set:
    return {(n, tuple(t.shape), t.dtype) for n, t in list(m.named_parameters(remove_duplicate=False))
            + list(m.named_buffers(remove_duplicate=False))}
