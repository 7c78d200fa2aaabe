"""A rank's sharded graph kept between launches: a relaunch skips capture, planning and rewrite.

The capture cache (:mod:`autoshard.launch.capture_share`) spares a second launch the
export, but every rank still loads the captured graph with its fake values
(symbolic shapes: most of a warm launch), plans it and rewrites it. This cache
keeps what that work ends in, per rank: the rewritten graph (its nodes, their
targets and arguments; of the fake values only the shapes the runtime self-check
compares with, as sympy expressions), the plan, and the input facts the module
needs. A relaunch with the same model, inputs, layout, options, world size and
autoshard source rebuilds the module from it and slices the model's own weights
through the plan, as the rewrite does.

On by default wherever the capture cache is (``AUTOSHARD_CACHE``); a folder
``launch`` beside the captures, shared with them (:mod:`autoshard.launch.cache_dir`:
the key, the owner check, the size bound); ``AUTOSHARD_LAUNCH_CACHE=off`` turns this one off alone
(a run that patches autoshard's rules at run time: the key sees source files, not patches). An entry is hashed: a torn or corrupt one is
rebuilt, never trusted; the key holds a hash of autoshard's own source, so an
edited checkout never runs an old rewrite. ``shard()`` uses an entry only where
every rank has its own (one small all-reduce), so the ranks never take
different paths. ``mode="auto"`` is keyed by what it searches with (the cluster,
``depth``, ``dp``) and its entry names the layout it chose: a relaunch searches
nothing either (a cluster profiled anew at each launch differs, and misses). A
``captured=`` graph bypasses the cache.
"""

from __future__ import annotations

import operator
import pickle
import warnings
from dataclasses import dataclass

import torch
from torch import fx

from ..runtime import selfcheck
from ..passes.rewrite import slice_params
from . import cache_dir
from .launched import mark_non_persistent

__all__ = ["LaunchEntry", "ShapeOnly", "launch_key", "entry_of", "fits", "rebuild", "enabled", "read", "write", "store"]

_KEEP_META = ("nn_module_stack",)       # what passes after the rewrite read (remat: the blocks)


def launch_key(capture_key: str, **facts) -> str:
    """The entry's key (:func:`autoshard.launch.cache_dir.key`): the capture's key (model,
    config, inputs, versions), the autoshard source, and ``facts`` (layout, world size,
    rank, options) by ``repr``."""
    return cache_dir.key(capture_key, *(f"{k}={facts[k]!r}" for k in sorted(facts)))


# ------------------------------------------------------------------ shapes instead of fake values

@dataclass(frozen=True)
class ShapeOnly:
    """What the runtime self-check reads of a capture value: its (symbolic) shape,
    the symbolic sizes as sympy expressions."""

    shape: tuple

    def dim(self) -> int:
        return len(self.shape)


def _shape_of(v):
    if isinstance(v, torch.Tensor):
        return ShapeOnly(selfcheck.shape_of(v))
    if isinstance(v, (tuple, list)):
        return type(v)(_shape_of(x) for x in v)
    return None


# ------------------------------------------------------------------ graph records

@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Group:
    label: str


@dataclass(frozen=True)
class _Op:
    qualname: str           # "aten::mm.default"


@dataclass(frozen=True)
class _Hop:
    name: str               # torch.ops.higher_order.<name>


def _op_of(target):
    if isinstance(target, torch._ops.OpOverload):
        return _Op(f"{target._schema.name}.{target._overloadname}")
    if isinstance(target, torch._ops.HigherOrderOperator):
        return _Hop(target.name())
    return target


def _target(t):
    if isinstance(t, _Op):
        ns_op, _, overload = t.qualname.rpartition(".")
        ns, _, op = ns_op.partition("::")
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    if isinstance(t, _Hop):
        return getattr(torch.ops.higher_order, t.name)
    return t


def _encode(a, groups: dict):
    if isinstance(a, fx.Node):
        return _Ref(a.name)
    if isinstance(a, str) and a in groups:
        return _Group(groups[a])
    if isinstance(a, tuple) and not hasattr(a, "_fields"):
        return tuple(_encode(x, groups) for x in a)
    if isinstance(a, list):
        return [_encode(x, groups) for x in a]
    if isinstance(a, dict):
        return {k: _encode(v, groups) for k, v in a.items()}
    if isinstance(a, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return _op_of(a)
    if isinstance(a, torch.device):
        return ("__device__", str(a))
    return a


def _decode(a, nodes: dict, groups: dict):
    if isinstance(a, _Ref):
        return nodes[a.name]
    if isinstance(a, _Group):
        return groups[a.label]
    if isinstance(a, (_Op, _Hop)):
        return _target(a)
    if isinstance(a, tuple) and len(a) == 2 and a[0] == "__device__":
        return torch.device(a[1])
    if isinstance(a, list):
        return [_decode(x, nodes, groups) for x in a]
    if isinstance(a, tuple):
        return tuple(_decode(x, nodes, groups) for x in a)
    if isinstance(a, dict):
        return {k: _decode(v, nodes, groups) for k, v in a.items()}
    return a


def _graph_record(gm: fx.GraphModule, groups: dict) -> tuple:
    """(the graph's code generator: its input / output pytree specs; one record per node)."""
    out = []
    for n in gm.graph.nodes:
        meta = {k: n.meta[k] for k in _KEEP_META if k in n.meta}
        if n.op == "placeholder" and "val" in n.meta:
            meta["val"] = _shape_of(n.meta["val"])
        if selfcheck.META in n.meta:
            name, spec, val = n.meta[selfcheck.META]
            meta[selfcheck.META] = (name, spec, _shape_of(val))
        out.append((n.op, n.name, _encode(n.target, groups) if n.op == "call_function" else n.target,
                    _encode(n.args, groups), _encode(n.kwargs, groups), meta))
    return gm.graph._codegen, out


def _graph_from(record: tuple, groups: dict) -> fx.Graph:
    codegen, records = record
    graph = fx.Graph()
    graph._codegen = codegen
    nodes: dict = {}
    for op, name, target, args, kwargs, meta in records:
        n = graph.create_node(op, _target(target) if op == "call_function" else target,
                              _decode(args, nodes, groups), _decode(kwargs, nodes, groups), name=name)
        if n.name != name:
            raise ValueError(f"node {name!r} came back as {n.name!r}")
        n.meta.update(meta)
        nodes[name] = n
    return graph


# ------------------------------------------------------------------ entries

@dataclass
class LaunchEntry:
    """What a rank needs to rebuild its sharded module without the capture."""

    graphs: dict            # "" -> the top graph's record; "submod_1" -> a subgraph's
    tensors: dict           # attribute path -> (kind, value): "param" / "buffer" / "const"
    plan: object            # the ShardingPlan
    facts: dict             # mode, input_names, constants, example_inputs, batch_inputs, pad_blocker, guards, ...
    groups: dict            # axes label -> c10d name when written (the graph's group arguments by label)
    modules: tuple = ()     # the module tree's paths in order ("" first): parameters come back in the same order
    order: tuple = ()       # parameter and buffer names in the module's order


def _tensor_kind(gm: fx.GraphModule, path: str) -> str:
    mod_path, _, attr = path.rpartition(".")
    mod = gm.get_submodule(mod_path) if mod_path else gm
    return "param" if attr in mod._parameters else "buffer" if attr in mod._buffers else "const"


def entry_of(gm: fx.GraphModule, plan, groups: dict, facts: dict) -> LaunchEntry:
    """The entry of a freshly rewritten module ``gm`` (before any weights callback)."""
    if not facts.get("guards") and any(n.op == "call_module" and n.target == "_guards_fn" for n in gm.graph.nodes):
        # export's input guards, but not the code they were built from (a capture loaded from
        # the program format): nothing to rebuild them from, so no entry (they stay checked)
        raise ValueError("the graph calls _guards_fn and the capture kept no guard code")
    by_name = {v: k for k, v in groups.items()}
    planned = {name for pp in plan.params for name in (pp.name,) + pp.aliases}
    graphs = {"": _graph_record(gm, by_name)}
    tensors = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        obj = operator.attrgetter(n.target)(gm)
        if isinstance(obj, fx.GraphModule):
            graphs[n.target] = _graph_record(obj, by_name)
        elif n.target not in planned:
            kind = _tensor_kind(gm, n.target)
            tensors[n.target] = (kind, obj.detach().clone() if isinstance(obj, torch.Tensor) else obj)
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        if name not in planned and name not in tensors:
            tensors[name] = (_tensor_kind(gm, name), t.detach().clone())
    order = tuple(name for name, _ in list(gm.named_parameters(remove_duplicate=False))
                  + list(gm.named_buffers(remove_duplicate=False)))
    modules = tuple(path for path, _ in gm.named_modules(remove_duplicate=False))
    return LaunchEntry(graphs=graphs, tensors=tensors, plan=plan, facts=facts, groups=dict(groups),
                       modules=modules, order=order)


def _set(root: torch.nn.Module, path: str, kind: str, value) -> None:
    parts = path.split(".")
    mod = root
    for p in parts[:-1]:
        if p not in mod._modules:
            mod._modules[p] = torch.nn.Module()
        mod = mod._modules[p]
    if kind == "param":
        mod._parameters[parts[-1]] = value
    elif kind == "buffer":
        mod._buffers[parts[-1]] = value
    elif kind == "module":
        mod._modules[parts[-1]] = value
    else:
        mod.__dict__[parts[-1]] = value


def _tensors(model: torch.nn.Module) -> dict:
    """``model``'s parameters and buffers by every name (tied ones under each)."""
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    return own


def fits(entry: LaunchEntry, model: torch.nn.Module) -> bool:
    """Whether ``model`` has every tensor the entry's plan slices, under each of its
    names, in the shape the plan was made for and frozen (``requires_grad=False``) as the plan
    has it: a frozen parameter plans no gradient collectives (checked before the ranks agree to use
    the entry: :func:`rebuild` then cannot fail on one rank alone)."""
    if entry.plan is None or "" not in entry.graphs:
        return False
    own = _tensors(model)
    for pp in entry.plan.params:
        for name in (pp.name,) + pp.aliases:
            t = own.get(name)
            if t is None or tuple(t.shape) != tuple(pp.hf_shape):
                return False
            if not pp.is_buffer and t.requires_grad != pp.trainable:     # frozen otherwise: other collectives
                return False
    if not entry.facts.get("guards") and any(op == "call_module" and target == "_guards_fn"
                                             for op, _, target, *_ in entry.graphs[""][1]):
        return False
    try:                # every operator resolves (a library that registered one is loaded)
        for _, records in entry.graphs.values():
            for op, _, target, *_ in records:
                if op == "call_function":
                    _target(target)
    except (AttributeError, RuntimeError):
        return False
    return True


def rebuild(entry: LaunchEntry, model: torch.nn.Module, rank: int, groups: dict) -> fx.GraphModule:
    """This rank's rewritten module from ``entry``: its graph, ``model``'s own weights
    sliced through the plan (the vocabulary padded first where the plan padded it),
    group arguments renamed to this launch's groups, export's input guards rebuilt, the
    buffers the model keeps out of its ``state_dict`` kept out again."""
    from torch.export import _unlift

    names = {label: groups[label] for label in entry.groups}
    plan = entry.plan
    own = _tensors(model)
    root = torch.nn.Module()
    for path in entry.modules:          # the tree first, in its order (tied weights keep their first name)
        if path:
            _set(root, path, "module", torch.nn.Module())
    for path, record in entry.graphs.items():       # subgraphs take their places in it
        if path:
            _set(root, path, "module", fx.GraphModule(torch.nn.Module(), _graph_from(record, names)))
    # the model's own tensors, whole (the vocabulary padded as passes.pad pads it), as the
    # rewrite finds them; slice_params below cuts them as the rewrite does
    whole: dict = {}
    for pp in plan.params:
        full = own[pp.name]
        if pp.pad_dim is not None:
            full = pp.pad(full)
        value = torch.nn.Parameter(full.detach(), requires_grad=own[pp.name].requires_grad)
        for name in (pp.name,) + pp.aliases:
            whole[name] = value
    for name in entry.order + tuple(n for n in whole if n not in entry.order) \
            + tuple(n for n in entry.tensors if n not in entry.order):
        if name in whole:
            _set(root, name, "param", whole[name])
        elif name in entry.tensors:
            _set(root, name, *entry.tensors[name])
    graph = _graph_from(entry.graphs[""], names)
    guards = entry.facts.get("guards") or ()
    build = getattr(_unlift, "_convert_guards_code_to_fn", None)
    if any(n.op == "call_module" and n.target == "_guards_fn" for n in graph.nodes):
        if not guards or build is None:
            raise ValueError("the graph calls _guards_fn but the entry has no guards to rebuild it from")
        root._modules["_guards_fn"] = build(*guards)
    gm = fx.GraphModule(root, graph)
    for k in ("_modules", "_parameters", "_buffers"):         # the whole tree, unused tensors too
        setattr(gm, k, getattr(root, k))
    for k, v in vars(root).items():
        if isinstance(v, torch.Tensor):
            gm.__dict__[k] = v
    mark_non_persistent(gm, entry.facts.get("non_persistent", ()))     # state_dict() leaves them out, as the model's
    slice_params(gm, plan, plan.mesh, rank)
    gm.recompile()
    return gm


# ------------------------------------------------------------------ on disk

def enabled() -> bool:
    """Whether entries are read and written: off where ``AUTOSHARD_CACHE=off``, or
    ``AUTOSHARD_LAUNCH_CACHE=off`` for this one alone (a run that patches autoshard's
    rules at run time, which the key cannot see); see :func:`autoshard.launch.cache_dir.folder`."""
    return cache_dir.enabled("launch")


def read(key: str) -> LaunchEntry | None:
    """The entry of ``key``, or None (none, disabled, refused, torn, corrupt: the file is removed)."""
    blob = cache_dir.load("launch", key)
    if blob is None:
        return None
    try:
        with warnings.catch_warnings():         # torch's pytree warns of its own deprecated specs
            warnings.simplefilter("ignore", FutureWarning)
            entry = pickle.loads(blob)
    except Exception:  # noqa: BLE001 - an entry that does not load is rebuilt
        cache_dir.discard("launch", key)
        return None
    return entry if isinstance(entry, LaunchEntry) else None


def write(key: str, entry: LaunchEntry) -> None:
    """Store ``entry`` under ``key`` (atomic; best effort: an entry that does not pickle
    is not stored, with a warning once, and the next launch goes the full way)."""
    if not enabled():
        return
    try:
        blob = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - a graph argument that does not pickle: no entry
        _not_stored(e)
        return
    cache_dir.store("launch", key, blob)


def store(key: str, gm: fx.GraphModule, plan, groups: dict, facts: dict) -> None:
    """:func:`entry_of` the freshly rewritten ``gm`` written under ``key`` (best effort)."""
    try:
        entry = entry_of(gm, plan, groups, facts)
    except Exception as e:  # noqa: BLE001 - a graph this format cannot hold: no entry, no error
        _not_stored(e)
        return
    write(key, entry)


def _not_stored(e: Exception) -> None:
    """A warning, once per reason, that this launch leaves no entry."""
    why = f"{type(e).__name__}: {e}"
    cache_dir.warn_once(("not stored", why), f"autoshard launch cache: no entry stored for this launch ({why}); "
                                             f"the next launch captures, plans and rewrites again")
