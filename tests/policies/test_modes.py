"""Modes: mesh construction and its error messages, and the slices each mode
gives the tiny models (plans shared with test_plan.py through tiny_plans)."""

from __future__ import annotations

import re

import pytest

import autoshard
import tiny_plans as tp
from autoshard import ConfigError, Mesh
from autoshard.policies import POLICIES

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def _plan_error(**kw) -> str:
    """ConfigError text of autoshard.plan (validated before any model is built or captured)."""
    with pytest.raises(ConfigError) as ei:
        autoshard.plan(tp.config("llama"), **kw)
    return str(ei.value)


# ------------------------------------------------------------ config errors
def test_2d_non_square_names_nearest_squares():
    msg = _plan_error(world_size=8, mode="2d")
    m = re.search(r"Nearest valid: ([\d, ]+)", msg)
    assert m, msg
    near = [int(x) for x in m.group(1).split(",")]
    assert 9 in near and 4 in near                       # the squares either side of 8
    assert all(round(v ** 0.5) ** 2 == v and v >= 4 for v in near)
    assert near == sorted(near)
    assert "8" in msg


@pytest.mark.parametrize("world", [1, 2, 3, 12])
def test_2d_needs_a_square_of_at_least_four(world):
    with pytest.raises(ConfigError, match="square"):
        POLICIES["2d"].make_mesh(world)


def test_2d_rejects_depth():
    with pytest.raises(ConfigError, match="2.5d"):
        POLICIES["2d"].make_mesh(4, depth=2)
    assert POLICIES["2d"].make_mesh(4, depth=1) == Mesh(axes=("row", "col"), sizes=(2, 2))


def test_25d_without_depth_lists_valid_shapes():
    msg = _plan_error(world_size=12, mode="2.5d")
    assert "(q=2,d=3)" in msg
    assert "depth" in msg
    assert "(q=1" not in msg                              # q must be at least 2
    msg32 = str(pytest.raises(ConfigError, POLICIES["2.5d"].make_mesh, 32).value)
    assert "(q=2,d=8)" in msg32 and "(q=4,d=2)" in msg32


def test_25d_bad_depth_lists_valid_shapes():
    msg = _plan_error(world_size=8, mode="2.5d", depth=3)
    assert "depth=3" in msg
    assert "(q=2,d=2)" in msg


@pytest.mark.parametrize("depth", [0, -1, 5, 8])
def test_25d_depth_must_leave_a_square(depth):
    with pytest.raises(ConfigError, match="allow"):
        POLICIES["2.5d"].make_mesh(8, depth=depth)


def test_unknown_mode_lists_valid_modes():
    msg = _plan_error(world_size=4, mode="4d")
    assert "'4d'" in msg
    for mode in autoshard.MODES:
        assert repr(mode) in msg
    assert {"1d", "2d", "2.5d"} <= set(autoshard.MODES)


def test_1d_rejects_depth():
    msg = _plan_error(world_size=4, mode="1d", depth=2)
    assert "depth=2" in msg and "2.5d" in msg
    assert POLICIES["1d"].make_mesh(4, depth=1) == Mesh(axes=("tp",), sizes=(4,))


@pytest.mark.parametrize("mode, depth", [("1d", None), ("2d", None), ("2.5d", 2)])
def test_dp_must_divide_world(mode, depth):
    msg = _plan_error(world_size=8, mode=mode, depth=depth, dp=3)
    assert "dp=3" in msg
    assert "[1, 2, 4, 8]" in msg                          # the valid dp values are listed
    with pytest.raises(ConfigError):
        POLICIES[mode].make_mesh(8, depth=depth, dp=0)


@pytest.mark.parametrize("mode, world, depth, dp, axes, sizes", [
    ("1d", 8, None, 1, ("tp",), (8,)),
    ("1d", 8, None, 2, ("dp", "tp"), (2, 4)),
    ("2d", 4, None, 1, ("row", "col"), (2, 2)),
    ("2d", 8, None, 2, ("dp", "row", "col"), (2, 2, 2)),
    ("2d", 16, None, 1, ("row", "col"), (4, 4)),
    ("2.5d", 8, 2, 1, ("dep", "row", "col"), (2, 2, 2)),
    ("2.5d", 64, 4, 1, ("dep", "row", "col"), (4, 4, 4)),
    ("2.5d", 16, 2, 2, ("dp", "dep", "row", "col"), (2, 2, 2, 2)),
    ("2.5d", 12, 3, 1, ("dep", "row", "col"), (3, 2, 2)),
])
def test_meshes(mode, world, depth, dp, axes, sizes):
    mesh = POLICIES[mode].make_mesh(world, depth=depth, dp=dp)
    assert (mesh.axes, mesh.sizes) == (axes, sizes)
    assert mesh.world_size == world


# -------------------------------------------------------- slices per mode
def _llama_linear_params(plan):
    ps = [p for p in plan.params if p.name.rsplit(".", 2)[-2] in LLAMA_LINEARS]
    assert len(ps) == 7 * tp.config("llama").num_hidden_layers + 1
    return ps


def _norm_params(plan):
    ps = [p for p in plan.params if "norm" in p.name]
    assert len(ps) == 2 * tp.config("llama").num_hidden_layers + 1
    return ps


@pytest.mark.parametrize("mode, world, depth, linear_sync, norm_sync", [
    ("2d", 4, None, (), ("row",)),
    ("2.5d", 8, 2, ("dep",), ("dep", "row")),
])
def test_llama_2d_25d_slices(mode, world, depth, linear_sync, norm_sync):
    plan = tp.plan_for("llama", mode, world, depth)
    for p in _llama_linear_params(plan):
        assert str(p.spec) == "[S(col), S(row)]", p.name
        assert p.grad_sync == linear_sync, p.name
    for p in _norm_params(plan):
        assert str(p.spec) == "[S(col)]", p.name
        assert p.grad_sync == norm_sync, p.name
    emb = plan.param("model.embed_tokens.weight")
    assert str(emb.spec) == "[R, S(col)]" and emb.grad_sync == norm_sync


@pytest.mark.parametrize("world", [2, 4])
def test_llama_1d_slices(world):
    """Column-parallel q/k/v/gate/up/lm_head, row-parallel o/down, vocab-parallel
    embedding. k and v are split too; where the kv heads are fewer than the ranks (GQA: 2
    kv heads on 4 ranks) each is held by the 2 ranks whose query heads read it, as copies
    whose gradients are summed over those ranks (docs/design.md, "Uneven widths")."""
    plan = tp.plan_for("llama", "1d", world)
    kv = tp.config("llama").num_key_value_heads
    for p in _llama_linear_params(plan):
        want = "[R, S(tp)]" if p.name.endswith(("o_proj.weight", "down_proj.weight")) else "[S(tp), R]"
        assert str(p.spec) == want, p.name
        assert p.grad_sync == ()
        if p.name.endswith(("k_proj.weight", "v_proj.weight")):
            assert p.pad_copies == (world // kv if kv < world else 0), p.name
            assert p.copy_group(plan.mesh) == max(1, world // kv)
    for p in _norm_params(plan):
        assert p.spec.is_replicated and p.grad_sync == ()
    assert str(plan.param("model.embed_tokens.weight").spec) == "[S(tp), R]"     # vocab-parallel


@pytest.mark.parametrize("world", [2, 4])
def test_gpt2_1d_fused_qkv(world):
    plan = tp.plan_for("gpt2", "1d", world)
    for i in range(tp.config("gpt2").n_layer):
        w = plan.param(f"transformer.h.{i}.attn.c_attn.weight")
        b = plan.param(f"transformer.h.{i}.attn.c_attn.bias")
        assert 3 in w.spec.segments and w.spec.dims == ((), ("tp",))         # Conv1D weight is [in, 3·out]
        assert str(w.spec) == "[R, S(tp)x3]"
        assert b.spec.segments == (3,) and b.spec.dims == (("tp",),)
        assert w.local_shape(plan.mesh) == (64, 3 * 64 // world)


def test_gpt2_tied_head_keeps_one_parameter():
    for case in [("gpt2", "1d", 2, None), ("gpt2", "2d", 4, None)]:
        plan = tp.plan_for(*case)
        head = plan.param("lm_head.weight")
        assert head.aliases == ("transformer.wte.weight",)
        assert not [p for p in plan.params if p.name == "transformer.wte.weight"]


@pytest.mark.parametrize("case", tp.MATRIX, ids=[tp.case_id(c) for c in tp.MATRIX])
def test_no_fallbacks(case):
    plan = tp.plan_for(*case)
    assert plan.fallbacks == []
    assert not any(n.fallback for n in plan.nodes)
    assert not any("fallback" in note for n in plan.nodes for note in n.notes)


@pytest.mark.parametrize("case", tp.MATRIX, ids=[tp.case_id(c) for c in tp.MATRIX])
def test_mode_axes(case):
    name, mode, world, depth = case
    plan = tp.plan_for(*case)
    if mode == "1d":
        assert plan.tp_axes == ("tp",) and plan.batch_axes == ()
    elif mode == "2d":
        assert plan.tp_axes == ("row", "col") and plan.batch_axes == ("row",)
    else:
        assert plan.tp_axes == ("dep", "row", "col") and plan.batch_axes == ("dep", "row")
    used = {a for p in plan.params for a in p.spec.axes + p.grad_sync}
    assert used <= set(plan.mesh.axes)
