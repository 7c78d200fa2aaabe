"""The plan's per-rank figures against the papers' formulas (no processes).

* Tesseract (its memory formula): per Linear Y = X·W with X:[a,b], W:[b,c] on p = d·q² ranks,
  memory M = ab/p + bcd/p + ac/p.
* docs/design.md, "Communication and memory": communication per rank per step: 2D / 2.5D 3(q−1)/q²·(Nk/d + kn) per
  Linear plus the depth all-reduce 2(d−1)/d·kn/q²; 1D 8(p−1)/p·N·h per layer.
"""

from __future__ import annotations

import math

import pytest

import tiny_plans as tp

B, S = tp.BATCH, tp.SEQ
N = B * S


def _plan(name, world, mode, depth=None):
    """``autoshard.ir.plan`` of the tiny config (batch B × seq S) through tiny_plans: one
    export per model, shared with the other planning tests."""
    return tp.plan_for(name, mode, world, depth)


def _summa_nodes(plan):
    return [n for n in plan.nodes if n.kernel is not None and n.kernel.name == "summa"]


@pytest.mark.parametrize("name,world,mode,depth", [
    ("llama", 4, "2d", None), ("llama", 8, "2.5d", 2), ("gpt2", 8, "2.5d", 2), ("bert", 4, "2d", None)],
    ids=["llama-2d-q2", "llama-2.5d-q2d2", "gpt2-2.5d-q2d2", "bert-2d-q2"])
def test_tesseract_memory_and_comm_formula(name, world, mode, depth):
    plan = _plan(name, world, mode, depth)
    mesh = plan.mesh
    q, d = mesh.size("row"), (mesh.size("dep") if "dep" in mesh.axes else 1)
    p = d * q * q
    nodes = _summa_nodes(plan)
    assert nodes, "no SUMMA Linear planned"
    params = {pp.name: pp for pp in plan.params}
    for n in nodes:
        a = math.prod(n.global_shape[:-1])      # tokens
        c = n.global_shape[-1]                  # out features
        assert a == N
        # the weight operand's plan: [n, k] (linear) or [k, n] (Conv1D)
        w = next(pp for pp in params.values() if pp.name.replace(".", "_") in _weight_arg(plan, n))
        b = w.global_shape[1] if w.global_shape[0] == c else w.global_shape[0]
        assert math.prod(n.local_shape) == a * c // p                       # ac/p
        assert math.prod(w.local_shape(mesh)) == b * c * d // p             # bcd/p
        x_local = a * b // p                                                # ab/p
        # the all-gather of X over col carries q blocks of the local X
        ag_x = [cm for cm in n.comms if cm.phase == "fwd" and cm.axes == ("col",)][0]
        assert ag_x.buffer_bytes == x_local * q * 4
        # docs/design.md, "Communication and memory": 3(q−1)/q²·(Nk/d + kn) bytes per rank per step
        expect = 3 * (q - 1) / q ** 2 * (a * b / d + b * c) * 4
        assert sum(cm.bytes_per_rank for cm in n.comms) == pytest.approx(expect, rel=1e-12)
        # depth all-reduce of the weight gradient: 2(d−1)/d·kn/q²
        sync = [cm for cm in plan.grad_sync_comms() if cm.axes == ("dep",) and cm.buffer_bytes == b * c // q ** 2 * 4]
        if d > 1:
            assert w.grad_sync == ("dep",)
            assert sync and sync[0].bytes_per_rank == pytest.approx(2 * (d - 1) / d * b * c / q ** 2 * 4)
        else:
            assert w.grad_sync == ()


def _weight_arg(plan, node_plan) -> str:
    # weight names appear in the module path of the node; match by module prefix
    return node_plan.module.replace(".", "_") + "_weight"


@pytest.mark.parametrize("name,world", [("gpt2", 2), ("gpt2", 4), ("llama", 2)])
def test_one_d_comm_per_layer(name, world):
    """Megatron: per transformer layer 2 forward + 2 backward all-reduces of N·h.

    (Llama here has 2 kv heads: at 4+ ranks its kv projections are replicated and
    sliced per head, which adds their all-gathers; tested separately. Layer 1: the
    first layer's norm also reduces GPT-2's token + position lookups, partial sums.)"""
    plan = _plan(name, world, "1d")
    h = 64
    layer = "h.1." if name == "gpt2" else "layers.1."
    per_layer = sum(n.comm_bytes for n in plan.nodes if layer in n.module)
    assert per_layer == pytest.approx(8 * (world - 1) / world * N * h * 4)


def test_param_bytes_match_local_shapes():
    plan = _plan("llama", 8, "2.5d", 2)
    total = sum(math.prod(pp.local_shape(plan.mesh)) * pp.dtype_bytes for pp in plan.params)
    assert plan.param_bytes_per_rank == total


def test_gqa_kv_held_by_the_ranks_that_read_it_when_heads_do_not_divide():
    """2 kv heads at tp=4 (docs/design.md, "Uneven widths"): each kv head lives on the 2
    ranks whose query heads read it (k/v split, half of dense per rank, not whole), its
    gradient summed over those 2 ranks (one all-reduce per k/v weight)."""
    plan = _plan("llama", 4, "1d")
    kv = [n for n in plan.nodes if n.module.endswith(("k_proj", "v_proj"))]
    assert kv and all(n.weight != "replicated" for n in kv)
    for i in (0, 1):
        assert plan.param(f"model.layers.{i}.self_attn.q_proj.weight").spec.dims[0] == ("tp",)
        for w in ("k_proj", "v_proj"):
            p = plan.param(f"model.layers.{i}.self_attn.{w}.weight")
            assert p.spec.dims[0] == ("tp",) and p.copy_group(plan.mesh) == 2
            assert math.prod(p.local_shape(plan.mesh)) * 2 == math.prod(p.dense_shape)
    copies = plan.copy_sync_comms()
    assert len(copies) == 4 and all(c.group_size == 2 and c.kind == "all_reduce" for c in copies)
    assert plan.param("lm_head.weight").spec.dims[0] == ("tp",)      # vocab-parallel head


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_three_d_comm_formula(name):
    """3D (docs/design.md, "Communication and memory"): 2(q−1)/q³·(Nk + kn + Nn) bytes
    per rank per Linear; W has no replica."""
    plan = _plan(name, 8, "3d")
    q = 2
    nodes = [n for n in plan.nodes if n.kernel is not None and n.kernel.name == "three_d"]
    assert nodes
    for n in nodes:
        a, c = math.prod(n.global_shape[:-1]), n.global_shape[-1]
        # the forward all-gather of X carries [N/q, k/q]
        k = next(cm for cm in n.comms if cm.phase == "fwd" and cm.kind == "all_gather").buffer_bytes * q * q // (a * 4)
        expect = 2 * (q - 1) / q ** 3 * (a * k + k * c + a * c) * 4
        assert sum(cm.bytes_per_rank for cm in n.comms) == pytest.approx(expect, rel=1e-12), n.name
    for pp in plan.params:
        if len(pp.global_shape) == 2 and pp.spec.dims[0] and pp.spec.dims[1]:
            assert pp.grad_sync == ()        # every Linear weight is split over all three axes


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_three_d_no_activation_regathers(name):
    """Residual adds and norms never re-layout in 3D: Linear pairs land back on the
    residual layout. The only re-layouts are of integer / boolean tensors built on
    the input's (x,y) batch split and consumed where rows are split over (x,z):
    the attention mask (at the first attention) and the labels (at the loss)."""
    plan = _plan(name, 8, "3d")
    assert plan.fallbacks == []
    relayouts = [(n.name, n.op, path) for n in plan.nodes if n.name != "output"
                 for path, steps in n.arg_steps if any(s.op in ("gather", "scatter") for s in steps)]
    allowed = {("scaled_dot_product_attention", (3,)), ("cross_entropy_loss", (1,))}
    assert {(op, path) for _, op, path in relayouts} <= allowed, relayouts
    # the mask is re-laid out once and shared by every later attention
    assert sum(1 for n in plan.nodes if n.op == "scaled_dot_product_attention" and n.comms) == 1
