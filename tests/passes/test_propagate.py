"""propagate: re-layout steps, Megatron communication pattern, shape bookkeeping,
errors. Plans come from tiny_plans (the same plans test_plan.py checks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

import models
import tiny_plans as tp
from autoshard import Mesh, ShardingError, ShardSpec
from autoshard.passes.pipeline import plan_captured
from autoshard.passes.layouts import redistribute as _redistribute
from autoshard.passes.propagate import propagate
from autoshard.ir.plan import Comm, Step
from autoshard.policies import POLICIES

MESH = Mesh(axes=("row", "col"), sizes=(2, 2))


def S(*dims, segments=(), partial=()):
    return ShardSpec(dims=tuple(tuple(d) for d in dims), segments=segments, partial=partial)


# ---------------------------------------------------------------- re-layouts
@pytest.mark.parametrize("cur, req, steps", [
    (S(["row"], []), S(["row"], []), []),
    (S([], [], partial=("col",)), S([], []), [Step(op="reduce_from", axes=("col",))]),
    (S([], [], partial=("col",)), S([], ["col"]), [Step(op="reduce_scatter", axes=("col",), dim=1)]),
    (S(["row"], [], partial=("col",)), S(["row"], ["col"]), [Step(op="reduce_scatter", axes=("col",), dim=1)]),
    (S([], ["col"]), S([], []), [Step(op="gather", axes=("col",), dim=1)]),
    (S([], []), S(["row"], []), [Step(op="scatter", axes=("row",), dim=0)]),
    (S(["col"], []), S(["row"], []), [Step(op="gather", axes=("col",), dim=0), Step(op="scatter", axes=("row",), dim=0)]),
    (S([], ["col"], segments=(1, 3)), S([], ["col"]),
     [Step(op="gather", axes=("col",), dim=1, segments=3), Step(op="scatter", axes=("col",), dim=1)]),
    (S([], []), S([], ["col"], segments=(1, 3)), [Step(op="scatter", axes=("col",), dim=1, segments=3)]),
    # a fused (segmented) target cannot take a plain reduce-scatter
    (S([], [], partial=("col",)), S([], ["col"], segments=(1, 3)),
     [Step(op="reduce_from", axes=("col",)), Step(op="scatter", axes=("col",), dim=1, segments=3)]),
], ids=["same", "reduce", "reduce-scatter", "reduce-scatter-keeps-rows", "gather", "scatter", "move-dim0",
        "regroup-segments", "scatter-segments", "partial-to-segments"])
def test_redistribute(cur, req, steps):
    assert _redistribute(cur, req, MESH) == steps


def _simulate(blocks, step, mesh):
    """Per-rank blocks after one collective step (plain tensor ops, no processes)."""
    n = mesh.world_size
    group = [mesh.group_ranks(step.axes, r) for r in range(n)]
    if step.op == "reduce_from":
        return [sum(blocks[o] for o in group[r]) for r in range(n)]
    if step.op == "reduce_scatter":
        return [sum(blocks[o] for o in group[r]).chunk(len(group[r]), step.dim)[mesh.index(step.axes, r)]
                for r in range(n)]
    if step.op == "gather":
        m = step.segments
        return [torch.cat([torch.cat([blocks[o].chunk(m, step.dim)[j] for o in group[r]], step.dim)
                           for j in range(m)], step.dim) for r in range(n)]
    if step.op == "scatter":
        m = step.segments
        return [torch.cat([seg.chunk(len(group[r]), step.dim)[mesh.index(step.axes, r)]
                           for seg in blocks[r].chunk(m, step.dim)], step.dim) for r in range(n)]
    raise AssertionError(step.op)


@pytest.mark.parametrize("cur, req", [
    (S(["row"], [], partial=("col",)), S([], [])),
    (S([], [], partial=("col",)), S(["row"], ["col"])),
    (S(["row"], [], partial=("col",)), S(["row"], ["col"])),
    (S(["row", "col"], []), S(["col"], ["row"])),
    (S([], ["col"], segments=(1, 3)), S(["col"], [])),
    (S([], ["col"], segments=(1, 3)), S([], ["col"])),
    (S([], [], partial=("row", "col")), S([], ["row", "col"])),
    (S(["col"], ["row"]), S(["row"], ["col"], segments=(1, 3))),
], ids=["partial-to-rep", "partial-to-2d", "partial-rs", "swap-multi", "segments-to-rows", "segments-to-plain",
        "partial-2axes-rs", "to-segments"])
def test_redistribute_moves_the_data(cur, req):
    """Executing the steps on per-rank blocks turns ``cur``'s layout of a tensor into ``req``'s."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(4, 24, generator=g, dtype=torch.float64)
    n = MESH.world_size
    blocks = [cur.local(t, MESH, r) for r in range(n)]
    if cur.partial:                                  # partial: the blocks sum to the value over those axes
        blocks = [b / MESH.size(cur.partial) for b in blocks]
    for st in _redistribute(cur, req, MESH):
        blocks = _simulate(blocks, st, MESH)
    for r in range(n):
        assert torch.allclose(blocks[r], req.local(t, MESH, r)), r


# ------------------------------------------------------------- whole plans
def test_propagate_is_what_plan_returns():
    cap = tp.cached_capture(tp.meta_model("llama"))
    pol = POLICIES["2d"](POLICIES["2d"].make_mesh(4))
    direct = plan_captured(cap, pol, batch_size=tp.BATCH, seq_len=tp.SEQ)
    assert direct.to_json() == tp.plan_for("llama", "2d", 4).to_json()
    # propagation alone decides everything but what the trace pass adds (saved tensors)
    untraced = propagate(cap, pol, batch_size=tp.BATCH, seq_len=tp.SEQ)
    assert all(n.saved is None for n in untraced.nodes)
    strip = dataclasses.replace(direct, nodes=tuple(dataclasses.replace(n, saved=None) for n in direct.nodes))
    assert untraced.to_json() == strip.to_json()


def test_gather_outputs_false_leaves_outputs_split():
    cap = tp.cached_capture(tp.meta_model("llama"))
    pol = POLICIES["1d"](POLICIES["1d"].make_mesh(2))
    kept = propagate(cap, pol, batch_size=tp.BATCH, seq_len=tp.SEQ, gather_outputs=False)
    full = tp.plan_for("llama", "1d", 2)
    assert [n.name for n in full.nodes if n.op == "output"] == ["output"]
    assert not [n for n in kept.nodes if n.op == "output"]
    out = full.node("output")
    assert [c.kind for c in out.comms] == ["all_gather"]            # logits [b, s, vocab/tp] gathered
    assert len(kept.comms()) == len(full.comms()) - 1


# 1D, per layer: the column / row pair of attention and of the MLP (Megatron's f and g)
ROW_MODULES = {"gpt2": ("attn.c_proj", "mlp.c_proj"), "llama": ("self_attn.o_proj", "mlp.down_proj"),
               "bert": ("attention.output.dense", "output.dense")}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_1d_megatron_pattern(name, world):
    plan = tp.plan_for(name, "1d", world)
    L = tp.config(name).num_hidden_layers
    linears = [n for n in plan.nodes if n.kind == "linear"]
    rows = [n for n in linears if n.kernel is not None and n.kernel.name == "row_linear"]
    assert len(rows) == 2 * L
    assert all(n.module.endswith(ROW_MODULES[name]) for n in rows)
    # forward: exactly one all-reduce per row-parallel Linear
    for n in rows:
        assert [(c.phase, c.kind, c.axes) for c in n.comms] == [("fwd", "all_reduce", ("tp",))]
    # backward: one all-reduce per replicated input read by column-parallel Linears
    # (q, k and v share one; so do gate and up), i.e. 2 per layer plus the LM head
    layer_bwd = [c for n in linears if n not in rows for c in n.comms]
    assert all((c.phase, c.kind) == ("bwd", "all_reduce") for c in layer_bwd)
    assert len(layer_bwd) == 2 * L + 1
    # the all-reduced activation: [batch, seq, hidden] floats; ring cost 2(p-1)/p of it
    hidden = tp.config(name).hidden_size
    for c in rows[0].comms + tuple(layer_bwd):
        assert c.buffer_bytes == tp.BATCH * tp.SEQ * hidden * 4
        assert c.group_size == world
        assert c.bytes_per_rank == pytest.approx(2 * (world - 1) / world * c.buffer_bytes)
    # 1d has no parameter gradient all-reduce but the sums of kv-head copies (kv heads fewer
    # than the ranks: each held by the ranks whose query heads read it)
    assert plan.grad_sync_comms() == plan.copy_sync_comms()
    kv = tp.config(name).num_key_value_heads if hasattr(tp.config(name), "num_key_value_heads") else None
    assert bool(plan.copy_sync_comms()) == (kv is not None and kv < world)


@pytest.mark.parametrize("case", tp.MATRIX, ids=[tp.case_id(c) for c in tp.MATRIX])
def test_shapes_are_consistent_and_divisible(case):
    plan = tp.plan_for(*case)
    mesh = plan.mesh
    checked = 0
    for n in plan.nodes:
        if not isinstance(n.out_spec, ShardSpec) or not n.global_shape:
            continue
        s, g = n.out_spec, n.global_shape
        assert len(g) == s.ndim, n.name
        assert n.local_shape == s.local_shape(g, mesh), n.name
        for size, axes, m in zip(g, s.dims, s.segments):
            if axes:
                assert size % (mesh.size(axes) * m) == 0, (n.name, g, str(s))
        checked += 1
    assert checked > 10
    for p in plan.params:
        for size, axes, m in zip(p.global_shape, p.spec.dims, p.spec.segments):
            if axes:
                assert size % (mesh.size(axes) * m) == 0, p.name


@pytest.mark.parametrize("case", tp.MATRIX, ids=[tp.case_id(c) for c in tp.MATRIX])
def test_node_param_bytes_are_local_blocks(case):
    """A heavy node's parameter bytes are the local blocks of the parameters it reads."""
    plan = tp.plan_for(*case)
    by_name = {}
    for p in plan.params:
        for n in (p.name,) + p.aliases:
            by_name[n] = p
    mods = {}
    for p in plan.params:
        mods.setdefault(p.name.rpartition(".")[0], []).append(p)
    for n in plan.nodes:
        if n.kind not in ("linear", "embedding"):
            continue
        own = mods.get(n.module, [])
        if not own:               # a tied table read under another module's name
            assert n.param_bytes > 0
            continue
        expect = sum(p.local_bytes(plan.mesh) for p in own)
        assert n.param_bytes == expect, (n.name, n.module)


@pytest.mark.parametrize("mode, world, depth, axes", [("2d", 4, None, ("row",)), ("2.5d", 8, 2, ("dep", "row"))])
def test_batch_inputs_are_scattered(mode, world, depth, axes):
    plan = tp.plan_for("llama", mode, world, depth)
    inputs = [n for n in plan.nodes if n.kind == "input"]
    assert sorted(n.name for n in inputs) == ["attention_mask", "input_ids", "labels"]
    for n in inputs:
        assert n.post == (Step(op="scatter", axes=axes, dim=0),)
        assert n.local_shape == (tp.BATCH // plan.mesh.size(axes), tp.SEQ)


def test_comm_ring_factors():
    assert Comm(phase="fwd", kind="all_reduce", axes=("tp",), group_size=4, buffer_bytes=100).bytes_per_rank == 150
    assert Comm(phase="fwd", kind="all_gather", axes=("tp",), group_size=4, buffer_bytes=100).bytes_per_rank == 75
    assert Comm(phase="bwd", kind="reduce_scatter", axes=("tp",), group_size=4, buffer_bytes=100).bytes_per_rank == 75
    assert Comm(phase="fwd", kind="all_reduce", axes=(), group_size=1, buffer_bytes=100).bytes_per_rank == 0


def test_train_mode_dropout_runs_the_dropout_kernel_in_place():
    """Dropout keeps its input's layout and runs the Dropout kernel (no collective);
    the mask mode is the plan's; an unknown mode is refused."""
    from autoshard import ConfigError

    cls, cfg_cls, kw = models.TINY["gpt2"]
    cfg = getattr(transformers, cfg_cls)(**{**kw, "n_layer": 1, "resid_pdrop": 0.1})
    with torch.device("meta"):
        model = getattr(transformers, cls)(cfg)
    model.train()
    cap = tp.cached_capture(model)
    pol = POLICIES["1d"](POLICIES["1d"].make_mesh(2))
    plan = propagate(cap, pol, dropout="dense")
    drops = [n for n in plan.nodes if n.kernel is not None and n.kernel.name == "dropout"]
    assert len(drops) == 2 and all(n.kernel.mode == "dense" and n.kernel.p == 0.1 and not n.comms for n in drops)
    assert all(n.kernel.layout == n.out_spec for n in drops)
    with pytest.raises(ConfigError, match="dropout='on'; valid: 'sharded', 'dense'"):
        propagate(cap, pol, dropout="on")


def test_a_failing_rule_is_reraised_with_its_node_module_and_specs():
    """A rule's own bug (here a KeyError) surfaces as a ShardingError that names the
    node (``format_node``), its module path and its input specs, as fx passes do."""
    cls = POLICIES["1d"]

    class Broken(cls):
        def linear(self, ctx):
            raise KeyError("no such weight")

    cap = tp.cached_capture(tp.meta_model("llama"))
    with pytest.raises(ShardingError) as ei:
        propagate(cap, Broken(cls.make_mesh(2)), batch_size=tp.BATCH, seq_len=tp.SEQ)
    msg = str(ei.value)
    assert "Broken.linear rule failed: KeyError" in msg and "no such weight" in msg
    assert "node: %linear" in msg and "= call_function[target=torch.ops.aten.linear.default]" in msg
    assert "module: model.layers.0.self_attn.q_proj" in msg
    assert "input specs:" in msg and "'layer_norm" not in msg


def _headwise(rank, world, mode):
    import models

    return models.check(rank, world, "qwen3", mode)


# 1d is slow: the qwen3 1d cell of the architecture matrix runs the same model in `make test`
@pytest.mark.parametrize("mode", [pytest.param("1d", marks=pytest.mark.slow), "2d"])
def test_per_head_norms_keep_qkv_split(mode):
    """Qwen3-style q/k RMSNorm over head_dim between the projections and attention: a
    norm over a dim other than the split one is local, so 1d keeps q/k/v column-parallel
    (parameter bytes per rank within 1.15 × dense / 4), and the run equals dense."""
    import models
    from dist_pool import get_pool

    res = get_pool(4).run(_headwise, mode)
    assert all(r["failures"] == [] for r in res), res[0]["failures"][:5]
    dense = sum(p.numel() * p.element_size() for p in {id(p): p for p in models.build("qwen3").parameters()}.values())
    assert res[0]["param_bytes"] <= 1.15 * dense / 4, (res[0]["param_bytes"], dense / 4)
    assert res[0]["fallbacks"] == []


@pytest.mark.parametrize("arch", ["olmo2", "gemma3"])
def test_qk_norms_split_in_1d(arch):
    """OLMo-2's q/k RMSNorms over the whole projection (every head at once): in 1d the
    mean square over the split features is a partial sum all-reduced per token.
    Gemma-3's per-head norms compute in float and cast back (``type_as``), which the
    split now passes. q/k/o stay column/row-parallel, and the run equals dense (logits,
    loss, every local gradient, ledger = plan) at <= 0.55 of the dense parameter bytes
    per rank."""
    import models
    from dist_pool import get_pool

    res = get_pool(2).run(models.check, arch, "1d")
    for rank, r in enumerate(res):
        assert r["failures"] == [], f"rank {rank}: {r['failures'][:5]}"
        assert (r["ledger_bytes"], r["ledger_calls"]) == (r["plan_bytes"], r["plan_calls"]), f"rank {rank}"
        assert r["fallbacks"] == []
    dense = sum(p.numel() * p.element_size() for p in models.build(arch).parameters())
    assert res[0]["param_bytes"] <= 0.55 * dense, (res[0]["param_bytes"], dense)


def test_attention_sinks_keep_the_heads_split():
    """gpt-oss joins a per-head sink parameter to the scores and subtracts their max over
    the keys (``max.dim``) in eager attention: the look-ahead follows the head split
    through the rotary halves (``chunk``), repeat_kv (``unsqueeze``, ``expand``),
    ``QKᵀ`` and the max, so q/k/v/o split in 1d (the sinks, one value per head, stay
    whole and each rank reads its heads') and the run equals dense."""
    import warnings

    import transformers

    import autoshard
    import models
    from dist_pool import get_pool

    cls, cfg_cls, kw = models.TINY["gptoss"]
    cfg = getattr(transformers, cfg_cls)(**kw)
    cfg.architectures = [cls]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autoshard.plan(cfg, world_size=2, mode="1d", seq_len=8)
    whole = [n.module for n in plan.nodes if n.kind == "linear" and n.weight == "replicated"]
    assert not [m for m in whole if ".self_attn." in m], whole
    q = next(n for n in plan.nodes if n.module == "model.layers.0.self_attn.q_proj")
    assert q.weight != "replicated"
    res = get_pool(2).run(models.check, "gptoss", "1d")
    for rank, r in enumerate(res):
        assert r["failures"] == [], f"rank {rank}: {r['failures'][:5]}"
        assert (r["ledger_bytes"], r["ledger_calls"]) == (r["plan_bytes"], r["plan_calls"]), f"rank {rank}"


@pytest.mark.parametrize("mode,world", [("1d", 2), ("2d", 4)])
def test_experts_with_biases_and_an_interleaved_gate_up_split(mode, world):
    """gpt-oss's experts: ``gate_up[..., ::2]`` and ``[..., 1::2]`` of a column-split
    grouped matmul take every rank's share of gate and up (a strided slice of a split
    dim whose per-rank block is a multiple of the step), the per-expert biases are looked
    up by the sorted expert ids with their features split as the product's (in 2d the
    ids are in a rank-local order, one lookup row per id row), and a bias added in place
    to a row-parallel product is added after the sum. Parameter bytes per rank at 1d@2
    at most 0.55 of dense (the router, 4 outputs, stays whole); every mode equals dense."""
    import models
    from dist_pool import get_pool

    res = get_pool(world).run(models.check, "gptoss", mode)
    for rank, r in enumerate(res):
        assert r["failures"] == [], f"rank {rank}: {r['failures'][:5]}"
        assert (r["ledger_bytes"], r["ledger_calls"]) == (r["plan_bytes"], r["plan_calls"]), f"rank {rank}"
        assert r["fallbacks"] == [], r["fallbacks"]
    dense = sum(p.numel() * p.element_size() for p in {id(p): p for p in models.build("gptoss").parameters()}.values())
    if mode == "1d":
        assert res[0]["param_bytes"] <= 0.55 * dense, (res[0]["param_bytes"], dense)


def test_a_view_of_a_data_dependent_size_is_unknown_not_a_crash():
    """Idefics3's connector reshapes a size torch knows only as an unbacked symbol (``u8``):
    whether the split dim survives the view cannot be decided, so it is unknown (the split
    stops there, exactly) rather than a GuardOnDataDependentSymNode out of the rule."""
    from torch import fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from autoshard.passes.rule_context import view_dim as _view_dim

    env = ShapeEnv()
    u = env.create_unbacked_symint()
    with FakeTensorMode(shape_env=env):
        a, b = torch.empty(2, 4 * u), torch.empty(2, u, 4)
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = a
    v = g.call_function(torch.ops.aten.view.default, (x, [2, 8, 4]))
    v.meta["val"] = b
    assert _view_dim(v, x, 1) is None


def test_view_dim_follows_a_permute_and_fused_blocks_move_the_split_to_the_heads():
    """The look-ahead's view steps on timm's qkv: ``[B, N, 3·H·D]`` cut into
    ``[B, N, 3, H, D]`` moves a 3-block split to the heads (dim 3), ``permute(2, 0, 3, 1, 4)``
    takes it to dim 2, and ``unbind(0)`` leaves it on dim 1 of each piece; an unbind along
    the split dim itself stops it."""
    from torch import fx

    from autoshard.passes.rule_context import _past_blocks, view_dim

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 5, 3 * 4 * 8)
    v = g.call_function(aten.view.default, (x, [2, 5, 3, 4, 8]))
    v.meta["val"] = torch.empty(2, 5, 3, 4, 8)
    p = g.call_function(aten.permute.default, (v, [2, 0, 3, 1, 4]))
    p.meta["val"] = torch.empty(3, 2, 4, 5, 8)
    u = g.call_function(aten.unbind.int, (p, 0))
    u.meta["val"] = [torch.empty(2, 4, 5, 8)] * 3
    assert _past_blocks(v, x, 2, 3) == 3 and _past_blocks(v, x, 2, 1) is None
    assert view_dim(p, v, 3) == 2
    assert _past_blocks(u, p, 2, 3) == 1
    assert _past_blocks(u, p, 0, 3) is None


def test_walks_of_a_search_share_only_the_shapes_of_the_batch_and_sequence():
    """``Shapes(shared=...)``: a shape of the batch and sequence symbols alone is evaluated once
    for every walk of a graph at the same sizes; one with another symbol is evaluated per walk,
    whose probe prime is drawn in the order that walk meets the symbols (a second walk meeting
    ``v`` first gives it the first spare prime, as a walk of its own does)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from autoshard.passes.rule_context import Shapes
    from autoshard.policies.base import SymbolicSizes

    env = ShapeEnv()

    def symbol(name, hint):
        s = env.create_symbol(hint, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
        return env.create_symintnode(s, hint=hint), s

    (b, bsym), (s, ssym), (u, _), (v, _) = symbol("b", 4), symbol("s", 8), symbol("u", 5), symbol("v", 6)
    with FakeTensorMode(shape_env=env):
        x, xu, xv = torch.empty(b, s, 16), torch.empty(b, u, 16), torch.empty(b, v, 16)
    shared: dict = {}
    first = Shapes(bsym, ssym, 4, 8, shared=shared)
    assert [first.probe_val(t)[1] for t in (x, xu, xv)] == [SymbolicSizes.SEQ, 1_000_000_021, 1_000_000_033]
    second = Shapes(bsym, ssym, 4, 8, shared=shared)
    alone = Shapes(bsym, ssym, 4, 8)
    assert second.probe_val(xv) == alone.probe_val(xv) == (SymbolicSizes.BATCH, 1_000_000_021, 16)
    assert second.concrete_val(xv) == (4, 6, 16)
    assert second.probe_val(x) is first.probe_val(x) and second.concrete_val(x) == (4, 8, 16)
    assert len(shared) == 1


def test_remember_row_facts_pauses_the_garbage_collector_and_restores_it():
    """A search's candidate loop runs with the cyclic collector off (its full scans of the heap
    cost as much as the walks); on exit it is on again, unless it was off before."""
    import gc

    from autoshard.passes.propagate import remember_row_facts

    assert gc.isenabled()
    with remember_row_facts():
        assert not gc.isenabled()
        with remember_row_facts():
            assert not gc.isenabled()
        assert not gc.isenabled()          # the inner one leaves it to the outer
    assert gc.isenabled()
    gc.disable()
    try:
        with remember_row_facts():
            pass
        assert not gc.isenabled()          # off before: left off
    finally:
        gc.enable()
