"""autoshard.plan on the tiny GPT-2 / Llama / BERT: JSON round trip, table,
printing, summary, fingerprints. (The 7B-shape scale acceptance is in
test_plan_scale.py.)"""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from rich.console import Console

import autoshard
import tiny_plans as tp
from autoshard import ShardingPlan
from autoshard.ir.plan import NodePlan, ParamPlan

SUMMARY_KEYS = {"model", "mode", "mesh", "world_size", "batch_size", "seq_len", "param_bytes_per_rank",
                "comm_bytes_per_rank_fwd", "comm_bytes_per_rank_bwd", "collective_calls_per_step", "fallbacks",
                "parallel_fraction", "padding", "trainable_bytes_per_rank", "frozen_bytes_per_rank",
                "grad_bytes_per_rank"}

MODEL_CLASS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM"}

CASES = pytest.mark.parametrize("case", tp.MATRIX, ids=[tp.case_id(c) for c in tp.MATRIX])


def _console():
    buf = io.StringIO()
    return Console(file=buf, width=240, color_system=None), buf


@CASES
def test_json_round_trip(case):
    plan = tp.plan_for(*case)
    text = plan.to_json()
    json.loads(text)                                   # valid JSON
    back = ShardingPlan.from_json(text)
    assert back.to_json() == text
    assert back == plan                                # every dataclass field, nested specs included
    assert back.nodes == plan.nodes and back.params == plan.params and back.mesh == plan.mesh
    assert all(isinstance(n, NodePlan) for n in back.nodes)
    assert all(isinstance(p, ParamPlan) for p in back.params)
    assert back.fingerprint() == plan.fingerprint()
    assert back.summary() == plan.summary()


@CASES
def test_plan_basics(case):
    name, mode, world, depth = case
    plan = tp.plan_for(*case)
    assert plan.model == MODEL_CLASS[name]
    assert plan.mode == mode
    assert plan.mesh.world_size == world
    assert (plan.batch_size, plan.seq_len) == (tp.BATCH, tp.SEQ)
    kinds = [n.kind for n in plan.nodes]
    for k in tp.ANNOTATED_KINDS:
        assert k in kinds, f"no {k} node"
    assert kinds.count("loss") == 1
    names = [n.name for n in plan.nodes]
    assert len(set(names)) == len(names)
    # one ParamPlan per distinct tensor (tied weights once, with aliases)
    pnames = [p.name for p in plan.params] + [a for p in plan.params for a in p.aliases]
    assert len(set(pnames)) == len(pnames)


@CASES
def test_table_one_row_per_annotated_node(case):
    plan = tp.plan_for(*case)
    table = plan.table(all_layers=True)
    rows = list(table.columns[0]._cells)
    annotated = [n.name for n in plan.nodes if n.kind in tp.ANNOTATED_KINDS]
    inputs = [n.name for n in plan.nodes if n.kind == "input"]       # batch-split graph inputs (2d / 2.5d)
    assert [r for r in rows if r not in inputs] == annotated
    assert table.row_count == len(annotated) + len(inputs)
    if plan.batch_axes:
        assert inputs, "a batch-split plan shows where its inputs are scattered"
    else:
        assert not inputs
    # all_nodes=True (with all_layers=True) lists every node of the plan
    assert plan.table(all_nodes=True, all_layers=True).row_count == len(plan.nodes)
    # by default a layer the same as one above is one "same as" row (tests/ir/test_plan_table.py)
    assert plan.table().row_count <= table.row_count


@CASES
def test_show_prints(case):
    name, mode, world, depth = case
    plan = tp.plan_for(*case)
    console, buf = _console()
    plan.show(console)
    out = buf.getvalue()
    assert f"autoshard plan · {MODEL_CLASS[name]} · {mode} · mesh {plan.mesh}" in out
    assert f"parameters {plan.param_bytes_per_rank:,} B" in out
    assert "fallbacks: 0" in out
    assert "lm_head" in out or "decoder" in out


@CASES
def test_summary(case):
    name, mode, world, depth = case
    plan = tp.plan_for(*case)
    s = plan.summary()
    assert set(s) == SUMMARY_KEYS
    assert s["model"] == MODEL_CLASS[name] and s["mode"] == mode and s["world_size"] == world
    assert s["mesh"] == str(plan.mesh)
    assert s["fallbacks"] == []
    assert s["collective_calls_per_step"] == len(plan.comms()) > 0
    assert s["comm_bytes_per_rank_fwd"] > 0 and s["comm_bytes_per_rank_bwd"] > 0
    # parameter bytes: every rank's block, sliced for real (on meta), times the element size
    per_rank = {sum(tp.local_numel_by_slicing(p, plan.mesh, r) * p.dtype_bytes for p in plan.params if not p.is_buffer)
                for r in range(world)}
    assert per_rank == {s["param_bytes_per_rank"]}
    total = sum(p.dtype_bytes * _numel(p.global_shape) for p in plan.params if not p.is_buffer)
    assert total / world <= s["param_bytes_per_rank"] < total
    # the parallel fraction: bytes per rank against dense / the mode's weight split (the
    # TP size; q² in 2.5d, whose depth replicates the weights), and the split share
    f = s["parallel_fraction"]
    ways = world // (depth or 1) if mode == "2.5d" else world
    assert plan.weight_ways == ways
    # against the dense (Hugging Face) sizes: padding and kv copies count as cost
    dense = sum(p.dtype_bytes * _numel(p.hf_shape) for p in plan.params if not p.is_buffer)
    assert f["vs_ideal"] == s["param_bytes_per_rank"] / (dense / ways) >= 1
    split = sum(_numel(p.global_shape) for p in plan.params if not p.is_buffer and p.spec.axes)
    assert f["params_split"] == split / sum(_numel(p.global_shape) for p in plan.params if not p.is_buffer) > 0.5
    assert all(not plan.param(n).spec.axes for n in f["replicated"])


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def test_fingerprint_stable_across_independent_plans():
    """A second autoshard.plan of the same config (fresh model, fresh capture) gives the same fingerprint."""
    a = tp.plan_for("gpt2", "1d", 2)
    b = autoshard.plan(tp.config("gpt2"), world_size=2, mode="1d", batch_size=tp.BATCH, seq_len=tp.SEQ)
    assert b is not a
    assert b.fingerprint() == a.fingerprint()
    assert b.to_json() == a.to_json()
    # the fingerprint covers decisions, not the planned batch shape
    c = dataclasses.replace(a, batch_size=64, seq_len=32)
    assert c.fingerprint() == a.fingerprint()


def test_fingerprint_differs_across_modes_worlds_and_models():
    prints = {tp.case_id(c): tp.plan_for(*c).fingerprint() for c in tp.MATRIX}
    assert len(set(prints.values())) == len(prints), prints
    for v in prints.values():
        assert len(v) == 16 and int(v, 16) >= 0


def test_fingerprint_sees_a_changed_slice():
    plan = tp.plan_for("llama", "1d", 2)
    p0 = plan.params[1]
    flipped = dataclasses.replace(p0, spec=p0.spec.with_dim(0, ()).with_dim(1, ("tp",)))
    other = dataclasses.replace(plan, params=(plan.params[0], flipped) + plan.params[2:])
    assert other.fingerprint() != plan.fingerprint()


def test_node_and_param_lookup():
    plan = tp.plan_for("llama", "2d", 4)
    lm = plan.param("lm_head.weight")
    assert lm.global_shape == (128, 64)
    assert lm.local_shape(plan.mesh) == (64, 32)
    assert lm.local_bytes(plan.mesh) == 64 * 32 * 4
    head = next(n for n in plan.nodes if n.module == "lm_head")
    assert plan.node(head.name) is head
    with pytest.raises(KeyError):
        plan.param("no.such.weight")
    with pytest.raises(KeyError):
        plan.node("no_such_node")


def test_comms_by_phase():
    plan = tp.plan_for("gpt2", "2.5d", 8, 2)
    fwd, bwd = plan.comms("fwd"), plan.comms("bwd")
    assert fwd and bwd
    assert len(fwd) + len(bwd) == len(plan.comms())
    assert plan.comm_bytes_per_rank() == pytest.approx(plan.comm_bytes_per_rank("fwd") + plan.comm_bytes_per_rank("bwd"))
    # gradients of depth-replicated weights are all-reduced over dep after backward
    gs = plan.grad_sync_comms()
    assert gs and all(c.phase == "bwd" and c.kind == "all_reduce" and "dep" in c.axes for c in gs)


def test_a_batch_that_does_not_split_is_refused():
    """2.5d at 8 ranks (d=2, q=2) cuts the batch into dep·row = 4 blocks: 6 rows do
    not split (every local batch would be fractional), dp multiplies the blocks."""
    import autoshard
    from autoshard import ConfigError

    cfg = tp.config("llama")
    with pytest.raises(ConfigError, match=r"batch size 6 of batch_size is not divisible by the batch split 4 "
                                          r"\(2\.5d splits the batch over dep\[2\]·row\[2\]\); use a multiple of 4, "
                                          r"e\.g\. 4, 8"):
        autoshard.plan(cfg, world_size=8, mode="2.5d", depth=2, batch_size=6, seq_len=8)
    with pytest.raises(ConfigError, match=r"batch size 3 of batch_size is not divisible by the batch split 2 "
                                          r"\(dp\[2\]\)"):
        autoshard.plan(cfg, world_size=4, mode="1d", dp=2, batch_size=3, seq_len=8)


@pytest.mark.slow      # a CLIP capture and plans (15 s)
def test_a_refusal_past_the_maximum_positions_keeps_its_own_reason():
    """``plan()`` at a sequence longer than the model's positions blames the length only when
    the model plans at its maximum; CLIP's refusal with dp (its static batch) is its own."""
    import modality

    with pytest.raises(autoshard.ShardingError) as e:
        autoshard.plan(modality.build_meta("clip"), world_size=8, mode="2d", dp=2, seq_len=64, batch_size=4)
    assert "static batch" in str(e.value) and "max_position_embeddings" not in str(e.value), str(e.value)
