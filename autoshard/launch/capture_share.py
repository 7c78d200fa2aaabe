"""Capture once per job, not once per rank.

Every rank of a job captures the same graph: the model and the example inputs
are the same on every rank. :func:`capture_shared` lets rank 0 run
``torch.export`` and sends the others the captured graph module, pickled with its
fake values and shape environment (:func:`pack`: torch's ``GraphPickler``; its
weights swapped for meta tensors, so only the graph travels: a few hundred kB for
the test models; export's input guards rebuilt on arrival from the code export
built them from); each rank loads it and binds its own parameters and buffers to
it by name, exactly as :func:`~autoshard.passes.capture.capture` leaves the
model's own tensors in the captured module (rank 0 loads it too, so every rank
holds the same graph down to its node names). Loading it costs a tenth of an
export (0.15 s against 1.3 s for the benchmark's tiny Llama, where
``torch.export.load`` of the program took 0.3-0.5 s), and the ranks stop competing
for the CPU with 4-8 simultaneous exports. A graph the pickler cannot write goes
as ``torch.export.save`` of the program (the earlier format, still read).

A capture that fails on rank 0 raises the same error on every rank.

    >>> import transformers
    >>> m = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    >>> cap = capture_shared(m)                 # no process group: a plain capture
    >>> cap.input_names
    ('input_ids', 'attention_mask', 'labels', 'use_cache')
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import os
import pickle
import typing

import torch
from torch import fx

from ..ir.errors import CaptureError
from ..ir.log import logger
from . import cache_dir
from ..ir.signature import main_input, seq_input
from ..passes.capture import Captured, capture, input_symbols

__all__ = ["capture_shared", "capture_cached", "capture_for_plan", "pack", "unpack", "cache_key", "forget_loaded",
           "Unshippable"]


def _meta_state(ep) -> dict:
    out = {}
    for k, v in ep.state_dict.items():
        if isinstance(v, torch.nn.Parameter):
            out[k] = torch.nn.Parameter(v.detach().to("meta"), requires_grad=v.requires_grad)
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().to("meta")
        else:
            out[k] = v
    return out


def _class_name(x):
    return f"{x.__module__}.{x.__qualname__}" if isinstance(x, type) else x


def _skeleton(mod: torch.nn.Module, into: torch.nn.Module, memo: dict) -> torch.nn.Module:
    """``mod``'s tree in ``into``: parameters and buffers as meta tensors (tied ones stay
    tied), plain tensor attributes (export's lifted constants) with their values,
    subgraphs as :func:`_portable` copies; export's input guards as an empty stand-in."""
    def meta(t):
        if id(t) not in memo:
            m = t.detach().to("meta")
            memo[id(t)] = torch.nn.Parameter(m, requires_grad=t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else m
        return memo[id(t)]

    for k, p in mod._parameters.items():
        into._parameters[k] = None if p is None else meta(p)
    for k, b in mod._buffers.items():
        into._buffers[k] = None if b is None else meta(b)
    into._non_persistent_buffers_set = set(mod._non_persistent_buffers_set)
    for k, v in vars(mod).items():
        if isinstance(v, torch.Tensor):
            into.__dict__[k] = v
    for k, c in mod._modules.items():
        if k == "_guards_fn":               # a stand-in: unpack rebuilds it from Captured.guards
            into._modules[k] = torch.nn.Module()
            continue
        into._modules[k] = _portable(c, memo) if isinstance(c, fx.GraphModule) else _skeleton(c, torch.nn.Module(), memo)
    return into


def _portable(gm: fx.GraphModule, memo: dict) -> fx.GraphModule:
    """A copy of ``gm`` that pickles: its graph (node names, fake values, module paths
    with class names as text, stack traces; not export's provenance records) in a plain
    GraphModule without hooks, its tensors as :func:`_skeleton` keeps them."""
    with _quiet_treespecs():
        graph = copy.deepcopy(gm.graph)       # nodes are new, their meta dicts copies
    for n in graph.nodes:
        n.meta.pop("from_node", None)
        stack = n.meta.get("nn_module_stack")
        if stack:
            n.meta["nn_module_stack"] = {k: tuple(_class_name(x) for x in v) for k, v in stack.items()}
    skel = _skeleton(gm, torch.nn.Module(), memo)
    out = fx.GraphModule(skel, graph)
    # the constructor copies only what the graph names; keep the whole tree (unused
    # buffers, constants as attributes rather than buffers), as export's module has it
    for k in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
        setattr(out, k, getattr(skel, k))
    for k, v in vars(skel).items():
        if isinstance(v, torch.Tensor):
            out.__dict__[k] = v
    out.meta = {k: v for k, v in getattr(gm, "meta", {}).items() if k == "treespec_namedtuple_fields"}
    return out


@contextlib.contextmanager
def _quiet_treespecs():
    """Pickling the graph's input/output tree specs makes pytree warn that a ``LeafSpec``
    check is deprecated (torch's own code, on every dump and load): not the user's."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)
        yield


def pack(cap: Captured) -> bytes:
    """``cap`` as bytes: its graph module without weights (pickled with fake values
    and the shape environment, :class:`torch.fx._graph_pickler.GraphPickler`) and the
    capture's facts. A graph that does not pickle so (an op it cannot name) goes as
    ``torch.export.save`` of the program."""
    return _pack(cap)[0]


def _pack(cap: Captured) -> tuple[bytes, fx.GraphModule | None]:
    """``(pack(cap), the portable graph module it pickled)``; None for the program format."""
    from torch.fx._graph_pickler import GraphPickler, Options

    facts = {"model_name": cap.model_name, "input_names": cap.input_names, "constants": cap.constants,
             "example_inputs": {k: (v.to("cpu") if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
                                for k, v in cap.example_inputs.items()},
             "training": cap.training, "seq_range": cap.seq_range, "guards": cap.guards,
             "stamped": cap.stamped}
    try:
        portable = _portable(cap.module, {})
        with _quiet_treespecs():
            data = GraphPickler.dumps(portable, Options(ops_filter=None, node_metadata_key_filter=None))
        return pickle.dumps({"graph": data, "facts": facts}), portable
    except Exception:  # noqa: BLE001 - the program's own format carries what the graph pickler cannot
        if cap.program is None:
            raise
    ep = copy.copy(cap.program)
    ep._state_dict = _meta_state(cap.program)
    buf = io.BytesIO()
    try:
        torch.export.save(ep, buf)
    except Exception as e:  # noqa: BLE001 - neither format carries it: each rank captures its own
        raise Unshippable(cap, e) from e
    return pickle.dumps({"program": buf.getvalue(), "facts": facts}), None


def _as_loaded(portable: fx.GraphModule) -> fx.GraphModule:
    """``portable`` (:func:`pack`'s copy of a fresh capture) as its load would be: the
    fake mode export left on its values runs no fallback kernels, as the mode
    :func:`_load_graph` loads into (an op without a fake implementation fails the same
    on a capture made in this process and on one read from the cache)."""
    for n in portable.graph.nodes:
        mode = getattr(n.meta.get("val"), "fake_mode", None)
        if mode is not None:
            mode.allow_fallback_kernels = False
            break
    return portable


class Unshippable(Exception):
    """A capture neither the graph pickler nor ``torch.export.save`` can write (Gemma-3's
    multi-modal graph: a ``flat_apply`` node holding a ``TreeSpec``). It carries the
    capture: :func:`capture_shared` then has every rank capture the model itself (export
    is deterministic: the same model and inputs give every rank the same graph), with no
    disk cache."""

    def __init__(self, cap: Captured, cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cap = cap


_LOADED: dict[str, object] = {}       # sha256 of a packed graph / program -> its unbound load (this process)
_LOADED_MAX = 8


@contextlib.contextmanager
def _memoised(owner, name: str, key):
    """``owner.name`` remembered by ``key(*args, **kwargs)`` until the block ends (a call
    whose key is None passes through)."""
    orig = getattr(owner, name)
    memo: dict = {}

    def fn(*args, **kwargs):
        k = key(*args, **kwargs)
        if k is None:
            return orig(*args, **kwargs)
        if k not in memo:
            memo[k] = orig(*args, **kwargs)
        return memo[k]

    setattr(owner, name, fn)
    try:
        yield
    finally:
        setattr(owner, name, orig)


def _hints_key(obj, globalns=None, localns=None, include_extras=False):
    """``typing.get_type_hints`` of a class per namespace: torch's deserialiser asks it again
    for every node's dataclasses (5,000 calls, 40% of loading a tiny Llama); classes do
    not change during a load."""
    return (obj, id(globalns), include_extras) if isinstance(obj, type) and localns is None else None


def _sympify_key(a, locals=None, *args, **kwargs):
    """``sympy.sympify`` of a string: the deserialiser parses the same symbolic sizes (``s0``,
    ``s0*s1``, ...) once per tensor, each a full ``parse_expr``. Within one load a name always
    resolves to the one symbol it cached at first sight, so a repeated string gives the same
    expression."""
    return a if isinstance(a, str) and locals is not None and not args and not kwargs else None


def forget_loaded() -> None:
    """Drop the graphs and programs this process has loaded: the next load reads the
    bytes again, as a new process would (benchmarks of a second launch)."""
    _LOADED.clear()


def _load_program(data: bytes):
    """The ExportedProgram of ``torch.export.save``'s bytes. A process that loads the same
    program again (a second shard() of one model, a test worker) reuses the first load:
    each caller gets its own graph module from ``ep.module()``, which copies the graph."""
    key = hashlib.sha256(data).hexdigest()
    ep = _LOADED.get(key)
    if ep is None:
        import sympy

        with _memoised(typing, "get_type_hints", _hints_key), _memoised(sympy, "sympify", _sympify_key):
            ep = torch.export.load(io.BytesIO(data))
        _remember(key, ep)
    return ep


def _remember(key: str, loaded) -> None:
    while len(_LOADED) >= _LOADED_MAX:
        _LOADED.pop(next(iter(_LOADED)))
    _LOADED[key] = loaded


def _load_graph(data: bytes, guards: tuple) -> fx.GraphModule:
    """The graph module of :func:`pack`'s pickled graph, its fake values in a new fake
    mode whose shape environment is the capture's, export's input guards rebuilt. A
    process that loads the same bytes again (a second shard() of one model, a test
    worker) unpickles them once: each caller gets its own copy (:func:`_portable`: its
    graph and tensors to bind; the fake values shared, as ``ep.module()`` shares an
    exported program's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    key = hashlib.sha256(data).hexdigest()
    base = _LOADED.get(key)
    if base is None:
        mode = FakeTensorMode(allow_fallback_kernels=False, allow_non_fake_inputs=True, shape_env=ShapeEnv())
        with _quiet_treespecs():
            base = GraphPickler.loads(data, mode)
        _remember(key, base)
    return _from_base(base, guards)


def _from_base(base: fx.GraphModule, guards: tuple) -> fx.GraphModule:
    """A :func:`_portable` copy of ``base`` (a load, or the module :func:`pack` pickled)
    with export's input guards rebuilt."""
    from torch.export import _unlift

    gm = _portable(base, {})
    build = getattr(_unlift, "_convert_guards_code_to_fn", None)
    for node in gm.graph.find_nodes(op="call_module", target="_guards_fn"):
        if guards and build is not None:
            gm._modules["_guards_fn"] = build(*guards)
        else:
            gm._modules.pop("_guards_fn", None)
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def unpack(blob: bytes, model: torch.nn.Module, *, base: fx.GraphModule | None = None) -> Captured:
    """The :class:`Captured` of :func:`pack`'s bytes, bound to ``model``'s own parameters and buffers.
    ``base``: the graph module :func:`pack` pickled into ``blob``, taken as the graph's load
    (the process that packed the bytes skips reading them back: :func:`capture_cached`)."""
    d = pickle.loads(blob)
    f = d["facts"]
    if base is not None and "graph" in d:
        ep, gm = None, _from_base(_as_loaded(base), f.get("guards", ()))
    elif "graph" in d:
        ep, gm = None, _load_graph(d["graph"], f.get("guards", ()))
    else:
        ep = _load_program(d["program"])
        gm = ep.module()
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    for name, _ in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        if name not in own:
            raise CaptureError(f"the shared capture has tensor {name!r} that this rank's {type(model).__name__} "
                               f"does not: every rank must shard the same model")
        mod_path, _, attr = name.rpartition(".")
        mod = gm.get_submodule(mod_path) if mod_path else gm
        if attr in mod._parameters:
            mod._parameters[attr] = own[name]
        else:
            mod._buffers[attr] = own[name]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    example = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in f["example_inputs"].items()}
    sym = input_symbols(gm, main_input(example), seq_input(example))
    return Captured(program=ep, module=gm, model_name=f["model_name"], input_names=tuple(f["input_names"]),
                    constants=f["constants"], batch_symbol=sym[0], seq_symbol=sym[1], example_inputs=example,
                    training=f["training"], config=getattr(model, "config", None), seq_range=tuple(f["seq_range"]),
                    guards=tuple(f.get("guards", ())), stamped=f.get("stamped", False))


# ------------------------------------------------------------------ on-disk cache

def cache_key(model: torch.nn.Module, example_inputs: dict | None, tag: str = "") -> str:
    """What a capture depends on (:func:`autoshard.launch.cache_dir.key`): autoshard's own
    source (an edited capture pass is a new entry) and the versions of torch and
    transformers; the model's class and the source of its module; its config; its
    structure (submodule types, parameter and buffer names, shapes, dtypes, devices);
    train/eval mode; and the example inputs' names, dtypes, shapes and non-tensor values;
    ``tag`` names the capture function where it is not :func:`~autoshard.passes.capture.capture`."""
    import inspect
    import sys

    import transformers

    cls = type(model)
    try:
        src = inspect.getsource(sys.modules[cls.__module__])
    except (OSError, TypeError, KeyError):
        src = cls.__qualname__
    config = getattr(model, "config", None)
    parts = [torch.__version__, transformers.__version__, f"{cls.__module__}.{cls.__qualname__}",
             hashlib.sha256(src.encode()).hexdigest(),
             config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config),
             str(model.training), tag,
             ";".join(f"{n}:{type(m).__name__}" for n, m in model.named_modules()),
             ";".join(f"{n}:{_scalars(m)}" for n, m in model.named_modules()),
             ";".join(f"{n}:{tuple(t.shape)}:{t.dtype}:{t.device.type}"
                      for n, t in list(model.named_parameters(remove_duplicate=False))
                      + list(model.named_buffers(remove_duplicate=False)))]
    if example_inputs is not None:
        def one(k, v):
            if isinstance(v, torch.Tensor):
                return f"{k}:{tuple(v.shape)}:{v.dtype}"
            if isinstance(v, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in v):
                return f"{k}:[" + ",".join(f"{tuple(t.shape)}:{t.dtype}" for t in v) + "]"
            return f"{k}={v!r}"

        parts.append(";".join(one(k, v) for k, v in sorted(example_inputs.items())))
    return cache_dir.key(*parts)


def _scalars(module) -> str:
    """The plain-value attributes of ``module`` (numbers, flags, strings, and dicts of them),
    which a forward may bake into the graph: a LoRA layer's scaling and active adapter, a
    dropout's p. Two models alike but for one of them are different captures."""
    def plain(v):
        return isinstance(v, (bool, int, float, str, type(None))) or (
            isinstance(v, (dict, list, tuple)) and all(plain(x) for x in (v.values() if isinstance(v, dict) else v)))

    return repr(sorted((k, v) for k, v in vars(module).items() if not k.startswith("__") and plain(v)))


def _fn_tag(capture_fn) -> str:
    """What a capture function adds to the cache key: its name and its module's source
    (a step graph's forward is written there: an edited one is a new entry)."""
    if capture_fn is None:
        return ""
    import inspect
    import sys

    try:
        src = inspect.getsource(sys.modules[capture_fn.__module__])
    except (OSError, TypeError, KeyError):
        src = ""
    return f"{capture_fn.__module__}.{capture_fn.__qualname__}:{hashlib.sha256(src.encode()).hexdigest()}"


def _capture_blob(model, example_inputs, capture_fn=None, load=None) -> tuple:
    """``(blob, load(blob, base))``: the packed capture of ``model`` (by ``capture_fn``,
    default :func:`~autoshard.passes.capture.capture`) from the disk cache if an entry
    exists that ``load`` reads (``base`` None), else captured now and stored (``base``:
    the graph module :func:`pack` pickled, None for the program format). Without
    ``load`` an entry need only unpickle, and the second item is None."""
    key = cache_key(model, example_inputs, tag=_fn_tag(capture_fn))
    blob = cache_dir.load("capture", key)
    if blob is not None:
        try:
            return blob, (load or _unpickles)(blob, None)
        except Exception:  # noqa: BLE001 - an entry that does not load is rebuilt
            cache_dir.discard("capture", key)
    blob, base = _pack((capture_fn or capture)(model, example_inputs=example_inputs))
    cache_dir.store("capture", key, blob)
    return blob, (load(blob, base) if load else None)


def _unpickles(blob: bytes, base) -> None:
    pickle.loads(blob)


def capture_cached(model: torch.nn.Module, *, example_inputs: dict | None = None, capture_fn=None) -> Captured:
    """:func:`~autoshard.passes.capture.capture` (or ``capture_fn``) through the disk cache,
    in this process alone (no collective: for planning, which may run on one rank of a job).
    A capture made here is not read back from the bytes it was just packed into: the
    module :func:`pack` pickled stands for their load (its graph as a load has it, its
    fake values export's; the same plans, docs/design.md "Caches"), which
    saves a cold 7B plan the 0.25 s of unpickling 250 fake tensors."""
    try:
        return _capture_blob(model, example_inputs, capture_fn, load=lambda b, base: unpack(b, model, base=base))[1]
    except Unshippable as u:
        return u.cap


def capture_for_plan(model: torch.nn.Module, *, example_inputs: dict | None = None) -> Captured:
    """The capture planning reads, for a model on meta: exported with three layers per
    repeated stack and stamped to its depth (:mod:`~autoshard.passes.stamp`; a 7B Llama
    in seconds instead of a 32-layer export), through the disk cache. A model with
    real weights, or whose layers stamping cannot prove identical, is captured whole.
    ``AUTOSHARD_STAMP=0`` turns stamping off."""
    from ..io.builder import model_from
    from ..passes.stamp import capture_stamped

    if os.environ.get("AUTOSHARD_STAMP", "1").strip().lower() in ("0", "off", "false", "no"):
        return capture_cached(model, example_inputs=example_inputs, capture_fn=_capture_to_plan)

    def build(config):
        return model_from(config).train(model.training)

    def cached(m, **kw):
        return capture_cached(m, capture_fn=_capture_to_plan, **kw)

    return capture_stamped(model, build=build, capture_fn=cached, example_inputs=example_inputs)


def _capture_to_plan(model: torch.nn.Module, *, example_inputs: dict | None = None) -> Captured:
    """:func:`~autoshard.passes.capture.capture` without the nodes' source lines: a capture on
    meta is planned, never run (its own cache entries: :func:`_fn_tag`)."""
    return capture(model, example_inputs=example_inputs, stack_traces=False)


def capture_shared(model: torch.nn.Module, *, example_inputs: dict | None = None, capture_fn=None) -> Captured:
    """:func:`~autoshard.passes.capture.capture` (or ``capture_fn(model,
    example_inputs=...)``, e.g. :func:`autoshard.generate.capture_step`) on rank 0,
    loaded by the other ranks, through the disk cache (:mod:`autoshard.launch.cache_dir`): a second
    launch captures nothing.

    Collective when a process group of more than one rank is initialised (every rank
    calls it with the same model and inputs)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return capture_cached(model, example_inputs=example_inputs, capture_fn=capture_fn)
    msg: list = [None]
    own = None
    if dist.get_rank() == 0:
        try:
            msg[0] = ("ok", _capture_blob(model, example_inputs, capture_fn)[0])
        except Unshippable as u:        # every rank captures the model itself
            own, msg[0] = u.cap, ("local", str(u))
        except Exception as e:  # noqa: BLE001 - every rank raises it
            try:
                pickle.dumps(e)
                msg[0] = ("error", e)
            except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its text
                msg[0] = ("error", CaptureError(f"{type(e).__name__}: {e}"))
    dist.broadcast_object_list(msg, src=0)
    kind, payload = msg[0]
    if kind == "error":
        raise payload
    if kind == "local":
        logger.info("the capture does not serialise (%s): every rank captures the model itself", payload)
        return own if own is not None else (capture_fn or capture)(model, example_inputs=example_inputs)
    return unpack(payload, model)      # rank 0 too: every rank holds the very same graph (node names included)
