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
from .capture import Captured, capture, copy_sharing

__all__ = ["capture_stamped", "stamp", "shrink_config", "StampRefused", "KEEP", "Shallow"]

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
    g = _Stamper(gm, _find_stacks(list(gm.graph.nodes), lists)).emit()
    g.lint()
    gm.graph = g            # the setter recompiles (its code): once, not twice for a 32-layer graph
    return dataclasses.replace(cap, module=gm, program=None, stamped=True)


@dataclasses.dataclass(frozen=True)
class _Stacks:
    """The captured stacks to grow and where their layers sit in the graph."""

    nodes: list            # the captured graph's nodes, in order
    t: int                 # the template layer's index (the last captured)
    grow: dict             # list prefix -> full length
    tags: dict             # node -> (list prefix, layer index) or None
    layer: dict            # list prefix -> the template layer's nodes
    prev_of: dict          # list prefix -> {layer T-1 node: layer T's}


def _find_stacks(nodes: list[fx.Node], lists: dict[str, int]) -> _Stacks:
    """The stacks of ``lists`` the graph captured, with their last two layers checked to
    be one layer twice (:func:`_same_layer`)."""
    t = KEEP - 1
    grow = {p: n for p, n in lists.items() if any(_tag(x, (p,)) == (p, t) for x in nodes)}
    if not grow:
        raise StampRefused("no captured stack to grow")
    tags = {n: _tag(n, tuple(sorted(grow, key=len, reverse=True))) for n in nodes}
    layer = {p: [n for n in nodes if tags[n] == (p, t)] for p in grow}
    before = {p: [n for n in nodes if tags[n] == (p, t - 1)] for p in grow}
    for p in grow:
        _same_layer(before[p], layer[p], p, t, tags)
    prev_of = {p: {a: b for a, b in zip(before[p], layer[p])} for p in grow}
    return _Stacks(nodes=nodes, t=t, grow=grow, tags=tags, layer=layer, prev_of=prev_of)


class _Stamper:
    """Emits the full graph: every captured node once, and after each run of a stack's
    template layer its copies up to the stack's length (their tensors added to ``gm``)."""

    def __init__(self, gm: fx.GraphModule, stacks: _Stacks) -> None:
        self.gm, self.s = gm, stacks
        self.params = dict(gm.named_parameters(remove_duplicate=False))
        self.buffers = dict(gm.named_buffers(remove_duplicate=False))
        self.g = fx.Graph()                    # gm grows in place: the capture is this call's own
        self.env: dict[fx.Node, fx.Node] = {}
        self.copy_of: dict[tuple[int, fx.Node], fx.Node] = {}
        self.closed: set[str] = set()          # stacks whose layers are all emitted

    def emit(self) -> fx.Graph:
        """The new graph, nodes in the captured order with the copies after their template."""
        nodes, tags, t = self.s.nodes, self.s.tags, self.s.t
        k = 0
        while k < len(nodes):
            tg = tags[nodes[k]]
            if tg is not None and tg[1] == t:
                k = self._emit_layer_run(k)
                continue
            self.env[nodes[k]] = self._create_here(nodes[k])
            k += 1
        return self.g

    def _create(self, n: fx.Node, args, kwargs, name: str, target=None) -> fx.Node:
        """A node like ``n`` in the new graph, with ``n``'s meta."""
        r = self.g.create_node(n.op, n.target if target is None else target, args, kwargs, name, n.type)
        r.meta = dict(n.meta)
        return r

    def _create_here(self, n: fx.Node) -> fx.Node:
        """``n`` itself in the new graph, its inputs mapped by :meth:`_outside`."""
        return self._create(n, fx.map_arg(n.args, self._outside), fx.map_arg(n.kwargs, self._outside), n.name)

    def _emit_layer_run(self, k: int) -> int:
        """Emit the run of template-layer nodes starting at ``nodes[k]`` and its copies;
        the index after the run."""
        nodes, tags, t = self.s.nodes, self.s.tags, self.s.t
        tg = tags[nodes[k]]
        p = tg[0]
        j = k
        while j < len(nodes) and tags[nodes[j]] == tg:
            j += 1
        run = nodes[k:j]
        attrs = run[0].op == "get_attr"      # a layer is two runs: its parameters, then its ops
        if any((m.op == "get_attr") != attrs for m in run) or \
                len(run) != sum(1 for m in self.s.layer[p] if (m.op == "get_attr") == attrs):
            raise StampRefused(f"layer {t} of {p} is not one contiguous run of nodes")
        for m in run:
            self.env[m] = self._create_here(m)
        for i in range(t + 1, self.s.grow[p]):
            for n in run:
                self.copy_of[(i, n)] = self._copy_node(p, i, n)
        if not attrs:
            self.closed.add(p)
        return j

    def _copy_node(self, p: str, i: int, n: fx.Node) -> fx.Node:
        """Template node ``n`` of stack ``p`` as layer ``i``'s (a parameter renamed and added)."""
        t = self.s.t
        args = fx.map_arg(n.args, lambda x: self._copy_arg(p, i, x))
        kwargs = fx.map_arg(n.kwargs, lambda x: self._copy_arg(p, i, x))
        if n.op == "get_attr":
            target = n.target.replace(f"{p}.{t}.", f"{p}.{i}.", 1)
            self._add_tensor(target, self.params.get(n.target, self.buffers.get(n.target)))
            r = self._create(n, args, kwargs, target.replace(".", "_"), target)
        else:
            r = self._create(n, args, kwargs, _split_name(n.name)[0])
        r.meta = _rename_stack(n.meta, p, t, i)
        return r

    def _copy_arg(self, p: str, i: int, x: fx.Node) -> fx.Node:
        """Input ``x`` of a template node, as layer ``i``'s copy reads it."""
        t, tag = self.s.t, self.s.tags.get(x)
        if tag == (p, t):
            if (i, x) not in self.copy_of:
                raise StampRefused(f"layer {t} of {p} reads {x.name} before it is made")
            return self.copy_of[(i, x)]
        if tag == (p, t - 1):       # the layer before: its counterpart in copy i-1
            tx = self.s.prev_of[p][x]
            return self.env[tx] if i - 1 == t else self.copy_of[(i - 1, tx)]
        return self._outside(x)

    def _outside(self, x: fx.Node) -> fx.Node:
        """A value from outside the stack being emitted: a finished stack's template layer
        stands for its last copy (a decoder reading the encoder's last layer, the head)."""
        tx = self.s.tags.get(x)
        if tx is not None and tx[0] in self.closed:
            if tx[1] != self.s.t:
                raise StampRefused(f"a node after the layers of {tx[0]} reads its layer {tx[1]} ({x.name})")
            return self.copy_of[(self.s.grow[tx[0]] - 1, x)]
        return self.env[x]

    def _add_tensor(self, target: str, src) -> None:
        """A meta tensor like ``src`` at ``target`` in ``gm`` (modules made on the way)."""
        mod_path, _, attr = target.rpartition(".")
        owner = self.gm
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
            shallow = capture_fn(small, **kw)
            base = dataclasses.replace(shallow, module=copy_sharing(shallow.module))   # stamp grows its own
            cap = stamp(shallow, lists)
            if _tensors(cap.module) == _tensors(full):
                return dataclasses.replace(cap, config=config, shallow=Shallow(base=base, lengths=dict(lists)))
        except StampRefused:        # not one layer repeated: the whole model is exported below
            pass
    return capture_fn(full, **kw)


@dataclasses.dataclass(frozen=True)
class Shallow:
    """The export a stamped capture grew from: ``base`` holds ``KEEP`` layers of each stack
    of ``lengths`` (list prefix -> full length). The stamped layers are copies of one layer,
    so every figure the cost model sums over a plan's rows grows by the same amount per
    stamped layer: the search prices a candidate from ``base``'s plan alone, with and without
    each stack's middle layer (docs/design.md, "Pricing the search")."""

    base: Captured
    lengths: dict


def _tensors(m: nn.Module) -> set:
    return {(n, tuple(t.shape), t.dtype) for n, t in list(m.named_parameters(remove_duplicate=False))
            + list(m.named_buffers(remove_duplicate=False))}
