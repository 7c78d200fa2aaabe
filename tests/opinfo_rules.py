"""The rules checked against torch's own samples (tests/policies/test_opinfo.py), as
DTensor tests its sharding strategies.

Each sample of an OpInfo (``torch.testing._internal.common_methods_invocations.op_db``,
float32) is traced to ATen ops (``make_fx``, pre-dispatch: the ops a captured graph
holds), its batch dim symbolic as in a capture. Every traced node whose op has a rule
in :mod:`autoshard.policies.ops` is then planned for each input layout (batch
rows split, sequence split, last dim split, partial sums) by the rule itself, through
the propagate pass's own rule context, with the pass's retry on
:class:`~autoshard.policies.base.NeedReplicate`. On every rank the node's inputs are
cut to that layout, re-laid as the rule asks (the plan's re-layout steps, run by the
runtime's collectives), the op (or the rule's kernel) run on the local blocks with
the rule's patched sizes and post steps, and the local result, partial sums reduced,
compared with the rank's block of the op on whole tensors (atol = rtol = 1e-5;
integers exact). A layout the rule refuses (ShardingError) is counted, not failed.
"""

from __future__ import annotations

import zlib
import types

import torch
from torch import fx

#: layout -> (mesh axis, batch axes, what is split)
LAYOUTS = {"batch": ("row", ("row",)), "sequence": ("tp", ()), "feature": ("col", ()), "partial": ("col", ())}

# OpInfo names that reach a ruled op under another name
ALIASES = {
    "nn.functional.interpolate": ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
                                  "upsample_bilinear2d", "upsample_bicubic2d", "upsample_linear1d",
                                  "upsample_trilinear3d", "_upsample_nearest_exact2d"),
    "nn.functional.upsample_bilinear": ("upsample_bilinear2d",),
    "nn.functional.upsample_nearest": ("upsample_nearest2d",),
    "nn.functional.cross_entropy": ("cross_entropy_loss",),
    "nn.functional.pad": ("pad", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "replication_pad2d"),
    "nn.functional.scaled_dot_product_attention": ("scaled_dot_product_attention",),
    "nn.functional.conv_transpose2d": ("conv_transpose2d",),
    "T": ("numpy_T",),
    "mT": ("transpose",),
    "__getitem__": ("index", "slice", "select"),
    "split_with_sizes": ("split_with_sizes",),
    "nn.functional.dropout": ("dropout",),
}
# random or uninitialised results: nothing to compare
SKIP = {"empty_like", "empty", "new_empty", "dropout", "bernoulli", "rand_like", "randn_like", "randint_like",
        "normal", "uniform", "multinomial", "native_dropout"}
# ops the rules key on with no OpInfo of their own: hand-written samples (name, fn, tensors)
HAND = {
    "batch_norm_train": (lambda x, w, b: torch.nn.functional.batch_norm(
        x, torch.zeros(4), torch.ones(4), w, b, training=True), lambda: (torch.randn(6, 4, 3, 3), torch.rand(4) + .5,
                                                                         torch.randn(4))),
    "batch_norm_eval": (lambda x, w, b: torch.nn.functional.batch_norm(
        x, torch.randn(4) * .1, torch.rand(4) + .5, w, b, training=False), lambda: (torch.randn(6, 4, 5), torch.rand(4),
                                                                                    torch.randn(4))),
    "histc": (lambda x: torch.histc(x.flatten(), bins=5, min=-2, max=2), lambda: (torch.randn(6, 4),)),
    "type_as": (lambda x, y: x.type_as(y), lambda: (torch.randn(6, 4), torch.randn(6, 4))),
    "scatter_add": (lambda i, v: torch.zeros(5).scatter_add(0, i, v),
                    lambda: (torch.randint(0, 5, (6,)), torch.randn(6))),
    "cross_entropy_spatial": (lambda x, y, w: torch.nn.functional.cross_entropy(x, y, weight=w, ignore_index=1,
                                                                               label_smoothing=0.2),
                              lambda: (torch.randn(6, 5, 4, 2), torch.randint(0, 5, (6, 4, 2)), torch.rand(5) + .5)),
    "cross_entropy_none": (lambda x, y: torch.nn.functional.cross_entropy(x, y, reduction="none", label_smoothing=.1),
                           lambda: (torch.randn(6, 8), torch.randint(0, 8, (6,)))),
    "cross_entropy_sum": (lambda x, y: torch.nn.functional.cross_entropy(x, y, reduction="sum", ignore_index=2),
                          lambda: (torch.randn(6, 8), torch.randint(0, 8, (6,)))),
    "var_over_batch": (lambda x: x.var(0), lambda: (torch.randn(6, 4),)),
    "std_mean": (lambda x: x.std(0, keepdim=True) + x.mean(), lambda: (torch.randn(6, 4),)),
    "instance_norm": (lambda x: torch.nn.functional.instance_norm(x), lambda: (torch.randn(6, 4, 5),)),
    "group_norm": (lambda x, w: torch.nn.functional.group_norm(x, 2, w), lambda: (torch.randn(6, 4, 5), torch.rand(4))),
    "max_pool2d": (lambda x: torch.nn.functional.max_pool2d(x, 2), lambda: (torch.randn(6, 3, 4, 4),)),
    "adaptive_avg_pool2d": (lambda x: torch.nn.functional.adaptive_avg_pool2d(x, 1), lambda: (torch.randn(6, 3, 4, 4),)),
}


def ruled_ops() -> dict:
    """``{overload packet name: [ATen overloads]}`` of every op with a rule of its own
    (the op table, the per-sample table, batch norm)."""
    from autoshard.policies.generic import PER_SAMPLE, RULES
    from autoshard.policies.ops.pointwise import dropout, pointwise

    out: dict = {}
    # the elementwise ops filed under the pointwise rule (and dropout) are the tag-driven rule's, not rules of their own
    own = [op for op, rule in RULES.items() if rule not in (pointwise, dropout)]
    for op in own + [getattr(p, o) for p in PER_SAMPLE for o in p.overloads()]:
        if isinstance(op, torch._ops.OpOverload):
            out.setdefault(op._schema.name.split("::")[1], []).append(op)
    return out


def opinfos(names=None) -> list:
    """The OpInfos (float32 on CPU) whose name reaches a ruled op; ``names`` keeps those only."""
    from torch.testing._internal.common_methods_invocations import op_db

    ruled = set(ruled_ops())
    out = []
    for info in op_db:
        if names is not None and info.name not in names:
            continue
        if torch.float32 not in info.supported_dtypes("cpu"):
            continue
        reach = set(ALIASES.get(info.name, ())) | {info.name.split(".")[-1], (info.aten_name or "").split(".")[-1]}
        if reach & ruled:
            out.append(info)
    return out


def _trace(fn, tensors, static: bool = False):
    """``(gm, dense node values, batch symbol, B)``: ``fn`` traced with the leading dim of
    every tensor whose leading size is the first tensor's symbolic (as in a capture)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    B = tensors[0].shape[0] if tensors and tensors[0].dim() and not static else None
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    fakes = []
    for t in tensors:
        dyn = [DimDynamic.DYNAMIC if (i == 0 and B is not None and B >= 2 and s == B) else DimDynamic.STATIC
               for i, s in enumerate(t.shape)]
        fakes.append(mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dyn)))
    gm = make_fx(fn, tracing_mode="symbolic", pre_dispatch=True)(*fakes)
    bsym = None
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() and isinstance(v.shape[0], torch.SymInt):
            bsym = next(iter(v.shape[0].node.expr.free_symbols), None)
            break
    if bsym is not None and bsym in env.replacements:
        # the op pinned the batch to its size (a reshape to literal sizes): export would make
        # the batch static, so does the trace
        return _trace(fn, tensors, static=True)
    vals = {}

    class Rec(fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            vals[n.name] = r
            return r

    Rec(gm).run(*tensors)
    return gm, vals, bsym, B


class _Engine(types.SimpleNamespace):
    """What the propagate pass's rule context reads of its engine, for one node."""


def _ctx(node, specs, mesh, batch_axes, bsym, B):
    from autoshard.passes.rule_context import NodeContext as _Ctx, Shapes as _Shapes

    e = _Engine(mesh=mesh, batch_axes=batch_axes, training=True, dropout="sharded",
                policy=types.SimpleNamespace(cp_attention="gather", cp_order="contiguous"), params=set(),
                state=frozenset(), st=types.SimpleNamespace(specs=specs, param_spec={}, batch_index=set()),
                shapes=_Shapes(bsym, None, B or 1, 1), rows={}, forced=set(), forced_why={}, ann={},
                largest_embedding=None)
    return _Ctx(e, node)


def _plan(node, layout, mesh, batch_axes, bsym, B, vals):
    """``(given specs, choice)`` for ``node`` under ``layout``, or None when the layout
    splits nothing; the rule's NeedReplicate answered as the pass answers it (that input
    dim gathered, the rule asked again)."""
    from autoshard.ir.spec import ShardSpec, replicated
    from autoshard.policies.base import NeedReplicate, SymbolicSizes
    from autoshard.policies.generic import rule_for

    axis = LAYOUTS[layout][0]
    specs = {}
    ctx = _ctx(node, specs, mesh, batch_axes, bsym, B)
    split = False
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if not isinstance(v, torch.Tensor):
            specs[a.name] = None
            continue
        nd, sh = v.dim(), ctx.pshape(a)
        s = replicated(nd)
        real = vals[a.name].shape
        if layout == "batch" and nd and sh[0] == SymbolicSizes.BATCH and real[0] % 2 == 0:
            s = s.with_dim(0, (axis,))
        elif layout == "sequence" and nd >= 2 and real[1] % 2 == 0 and real[1] >= 2:
            s = s.with_dim(1, (axis,))
        elif layout == "feature" and nd and real[-1] % 2 == 0 and real[-1] >= 2:
            s = s.with_dim(nd - 1, (axis,))
        elif layout == "partial" and v.is_floating_point():
            s = ShardSpec(dims=s.dims, partial=(axis,))
        split |= s != replicated(nd)
        specs[a.name] = s
    if not split:
        return None
    given = dict(specs)
    rule = rule_for(node)
    for _ in range(16):
        try:
            return given, rule(ctx)
        except NeedReplicate as nr:
            from autoshard.ir.argpath import get_arg

            src = get_arg(node, nr.path)
            specs[src.name] = specs[src.name].with_dim(nr.dim, ())
    raise AssertionError(f"{node.name}: the rule kept asking for gathers")


def _local(t, spec, mesh, rank, seed):
    """Rank ``rank``'s block of whole ``t`` laid out as ``spec`` (a partial sum: blocks
    that add up to it, unequal and with noise, so a rule that passes a partial sum
    through an op not linear in it shows)."""
    if spec.partial:
        g = torch.Generator().manual_seed(seed)
        d = torch.randn(t.shape, generator=g, dtype=t.dtype)
        t = t + d if rank % 2 == 0 else -d
        spec = spec.with_partial(())
    return spec.local(t, mesh, rank)


def run_node(node, layout, given, choice, vals, mesh, rank, bsym, B, group):
    """The rule's local computation of ``node`` on this rank: its inputs re-laid, the op
    or kernel run, the post steps; returns the local output."""
    from autoshard.ir.argpath import apply_patches, get_arg
    from autoshard.passes.layouts import redistribute as _redistribute
    from autoshard.runtime import parallel_ops

    local = {}
    for a in node.all_input_nodes:
        if given.get(a.name) is not None:
            local[a.name] = _local(vals[a.name], given[a.name], mesh, rank, zlib.crc32(a.name.encode()))
    nl = types.SimpleNamespace(args=node.args, kwargs=node.kwargs)
    for path, req in choice.inputs.items():
        a = get_arg(node, path)
        if not isinstance(a, fx.Node) or a.name not in local:
            continue
        x = local[a.name]
        for st in _redistribute(given[a.name], req, mesh):
            x = parallel_ops.step(x, st.op, group(st.axes) if st.axes else None, st.dim, st.segments, st.factor)
        local[(a.name, path)] = x
    apply_patches(nl, tuple(choice.patches.items()))
    rows = B // mesh.size(LAYOUTS[layout][1]) if LAYOUTS[layout][1] else B

    def sub(x, path):
        if isinstance(x, fx.Node):
            if (x.name, path) in local:
                return local[(x.name, path)]
            if x.name in local:
                return local[x.name]
            v = x.meta.get("val")
            if isinstance(v, torch.SymInt):          # a size read from a local tensor: local rows
                return int(v.node.expr.xreplace({bsym: rows})) if bsym is not None else int(v)
            return vals[x.name]
        return x

    args = tuple((type(a)(sub(b, (i, j)) for j, b in enumerate(a)) if isinstance(a, (list, tuple)) else sub(a, (i,)))
                 for i, a in enumerate(nl.args))
    kwargs = {k: sub(v, ("kw", k)) for k, v in nl.kwargs.items()}
    if choice.kernel is not None:
        fn, kargs, kkw = parallel_ops.bind(choice.kernel, types.SimpleNamespace(args=args, kwargs=kwargs), group,
                                           lambda axes: mesh.size(axes))
        out = fn(*kargs, **kkw)
    else:
        out = node.target(*args, **kwargs)
    for st in choice.post:
        out = parallel_ops.step(out, st.op, group(st.axes) if st.axes else None, st.dim, st.segments, st.factor)
    return out


def compare(out, ref, spec, mesh, rank, group) -> str:
    """'' when local ``out`` is this rank's block of ``ref`` under ``spec`` (partial sums
    reduced first); else what differs."""
    from autoshard.runtime import collectives as C

    if isinstance(ref, (tuple, list)):
        specs = spec if isinstance(spec, tuple) else (spec,) * len(ref)
        for i, (o, r) in enumerate(zip(out, ref)):
            why = compare(o, r, specs[i], mesh, rank, group)
            if why:
                return f"output {i}: {why}"
        return ""
    if not isinstance(ref, torch.Tensor) or spec is None:
        return ""
    if spec.partial:
        out = C.all_reduce(out.contiguous(), group(spec.partial), "sum")
        spec = spec.with_partial(())
    want = spec.local(ref, mesh, rank)
    if tuple(out.shape) != tuple(want.shape):
        return f"local shape {tuple(out.shape)}, the block of the dense one is {tuple(want.shape)}"
    try:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5, equal_nan=True, check_dtype=False)
    except AssertionError as e:
        return str(e).splitlines()[0] + " " + " ".join(str(e).splitlines()[2:4])
    return ""


def _samples(names, hand, limit):
    """``(label, fn, tensors)`` per sample: OpInfo samples (float32, CPU) then hand-written ones."""
    import torch.utils._pytree as pytree

    out = []
    for info in opinfos(names) if names != () else []:
        torch.manual_seed(0)
        try:
            samples = list(info.sample_inputs("cpu", torch.float32, requires_grad=False))
        except Exception:  # noqa: BLE001 - an OpInfo that cannot make samples here
            continue
        for k, s in enumerate(samples[:limit]):
            leaves, spec = pytree.tree_flatten((s.input, s.args, s.kwargs))
            pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            if not pos:
                continue

            def fn(*ts, _leaves=leaves, _spec=spec, _pos=pos, _op=info.op):
                lv = list(_leaves)
                for i, t in zip(_pos, ts):
                    lv[i] = t
                inp, args, kwargs = pytree.tree_unflatten(lv, _spec)
                return _op(inp, *args, **kwargs)

            out.append((f"{info.name}#{k}", fn, [leaves[i] for i in pos]))
    for name in (hand if hand is not None else HAND):
        fn, make = HAND[name]
        torch.manual_seed(0)
        out.append((name, fn, list(make())))
    return out


def check(rank: int, world: int, names=None, hand=None, limit: int = 6, layouts=tuple(LAYOUTS),
          patch_fallback: bool = False) -> dict:
    """Run every sample's ruled nodes under every layout on this rank; returns
    ``{"covered": {op: [layouts]}, "mismatches": [...], "refused": n, "errors": [...]}``.
    ``patch_fallback`` puts back the fallback that kept the batch split (to show the test
    catches it)."""
    from autoshard.ir.mesh import Mesh
    from autoshard.policies import generic
    from autoshard.runtime.groups import mesh_group

    torch.set_num_threads(1)
    saved = (_fallbacks(), dict(generic.RULES))
    if patch_fallback:
        _keep_batch_fallback(generic)
    covered: dict = {}
    mismatches, errors, refused = [], [], 0
    meshes = {lay: Mesh(axes=(ax,), sizes=(world,)) for lay, (ax, _) in LAYOUTS.items()}
    for lay, mesh in meshes.items():
        mesh_group(mesh, mesh.axes, rank)
    try:
        for label, fn, tensors in _samples(names, hand, limit):
            try:
                gm, vals, bsym, B = _trace(fn, tensors)
            except Exception as e:  # noqa: BLE001 - a sample make_fx cannot trace: not a rule's fault
                errors.append(f"{label}: trace: {type(e).__name__}")
                continue
            for node in gm.graph.nodes:
                if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or \
                        node.target is torch.ops.aten.sym_size.int:
                    continue
                name = node.target._schema.name.split("::")[1]
                if name.rstrip("_") in SKIP or any(isinstance(v := a.meta.get("val"), torch.Tensor) and not v.numel()
                                                   for a in node.all_input_nodes):
                    continue
                for lay in layouts:
                    if name == "scaled_dot_product_attention" and (node.kwargs.get("dropout_p") or
                                                                   (len(node.args) > 4 and node.args[4])):
                        continue        # random: nothing to compare
                    if lay == "batch" and name == "sort":
                        continue        # a rank-local order by design (passes/row_order.py follows it)
                    mesh = meshes[lay]
                    batch_axes = LAYOUTS[lay][1]
                    from autoshard.ir.errors import ShardingError
                    from autoshard.runtime.groups import group_alias

                    try:
                        planned = _plan(node, lay, mesh, batch_axes, bsym, B, vals)
                    except ShardingError:
                        refused += 1
                        continue
                    except Exception as e:  # noqa: BLE001 - a rule that crashes is a finding
                        mismatches.append(f"{label} {node.target} [{lay}]: rule raised {type(e).__name__}: {e}")
                        continue
                    if planned is None:
                        continue
                    given, choice = planned
                    group = lambda axes, _m=mesh: group_alias(_m, tuple(axes))  # noqa: E731
                    try:
                        out = run_node(node, lay, given, choice, vals, mesh, rank, bsym, B, group)
                    except Exception as e:  # noqa: BLE001 - the local op failed on its blocks: a finding
                        mismatches.append(f"{label} {node.target} [{lay}]: local run raised "
                                          f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                        continue
                    why = compare(out, vals[node.name], choice.out, mesh, rank, group)
                    covered.setdefault(str(node.target), set()).add(lay)
                    if why:
                        mismatches.append(f"{label} {node.target} [{lay}] given "
                                          f"{ {k: str(v) for k, v in given.items() if v is not None} } -> "
                                          f"{choice.out}: {why}")
    finally:
        for mod, f in saved[0].items():
            mod.fallback = f
        generic.RULES.clear()
        generic.RULES.update(saved[1])
    return {"covered": {k: sorted(v) for k, v in covered.items()}, "mismatches": mismatches, "refused": refused,
            "errors": errors}


def _fallbacks() -> dict:
    """``{module: its fallback}`` for every op-family module of the policies that calls it."""
    import sys

    return {m: m.fallback for name, m in list(sys.modules.items())
            if name.startswith("autoshard.policies.ops.") and hasattr(m, "fallback")}


def _keep_batch_fallback(generic) -> None:
    """The fallback as it was before docs/design.md's batch contract: every split gathered
    except the batch rows, which an op with no rule was assumed to treat one by one
    (and train-mode ``batch_norm`` had no rule)."""
    from autoshard.ir.spec import ShardSpec
    from autoshard.policies.base import Choice
    from autoshard.policies.ops.common import batch_rows, tensor_args

    def old(ctx, reason):
        inputs = {}
        for path, a in tensor_args(ctx):
            s = ctx.spec(a)
            rows = batch_rows(ctx, a, s)
            inputs[path] = ShardSpec(dims=((rows.dims[0] if rows else ()),) + ((),) * (s.ndim - 1)) if s.ndim \
                else ShardSpec(dims=())
        return Choice(out=ctx.default_out_spec(ctx.node), inputs=inputs, fallback=True)

    for mod in _fallbacks():
        mod.fallback = old
    generic.RULES.pop(torch.ops.aten.batch_norm.default, None)
