"""Cost model and ``mode="auto"`` search (autoshard/planning/cost.py, autoshard/planning/search.py).

One tiny Llama is captured once per module and reused by every search, as the
search itself does across candidates.
"""

from __future__ import annotations

import io
import math

import pytest
import transformers
from rich.console import Console

import autoshard
from autoshard.planning.cost import CLUSTERS, Cluster, broadcast_time, collective_time, estimate, link_of
from autoshard.ir.errors import ConfigError
from autoshard.ir.mesh import Mesh
from autoshard.ir.plan import Comm
from autoshard.policies import POLICIES
from autoshard.planning.search import candidates, search

B, S = 8, 16
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)


@pytest.fixture(scope="module")
def cap():
    from autoshard.io.builder import model_from
    from autoshard.passes.capture import capture

    m = model_from(transformers.LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]))
    m.train()
    return capture(m)


# ------------------------------------------------------------------ candidates

def _tp_size(c) -> int:
    return {"1d": c.q, "2d": c.q ** 2, "2.5d": c.q ** 2 * c.d, "3d": c.q ** 3}.get(c.mode, c.mesh.world_size // c.dp)


@pytest.mark.parametrize("world", range(1, 65))
def test_every_candidate_is_a_valid_factorisation(world):
    cands = candidates(world)
    assert cands, f"no candidate for {world} ranks"
    for c in cands:
        mesh = POLICIES[c.mode].make_mesh(world, depth=c.depth, dp=c.dp)   # raises if invalid
        assert mesh == c.mesh and mesh.world_size == world
        assert world % c.dp == 0 and _tp_size(c) * c.dp == world, c
    # complete: every non-degenerate mesh a mode accepts is proposed
    found = {(c.mode, c.mesh) for c in cands}
    for mode, cls in POLICIES.items():
        for dp in (d for d in range(1, world + 1) if world % d == 0):
            for depth in [None] + [d for d in range(1, world + 1) if world % d == 0]:
                try:
                    mesh = cls.make_mesh(world, depth=depth, dp=dp)
                except ConfigError:
                    continue
                if 1 in [s for a, s in zip(mesh.axes, mesh.sizes) if a != "dp"]:
                    continue          # 2.5d with d = 1 is 2d; tp = 1 is the pure-dp candidate
                assert (mode, mesh) in found, (mode, mesh)
    assert sum(1 for c in cands if _tp_size(c) == 1) == 1       # one pure data-parallel candidate


def test_candidates_pin_depth_and_dp():
    assert {(c.mode, c.d) for c in candidates(32, depth=2)} == {("2.5d", 2)}
    assert all(c.dp == 2 for c in candidates(16, dp=2))
    with pytest.raises(ConfigError, match="unknown mode"):
        candidates(4, modes=["4d"])


# ------------------------------------------------------------------ cost model

def test_cluster_presets_and_validation():
    assert {"dgx-a100", "h100-sxm", "cpu-gloo", "tesseract-paper"} <= set(CLUSTERS)
    paper = Cluster.preset("tesseract-paper")
    assert paper.ranks_per_node == 4 and paper.intra_bw == 200e9 and paper.inter_bw == 25e9
    assert paper.memory_bytes == 40 * 2 ** 30
    with pytest.raises(ConfigError, match="presets: dgx-a100"):
        Cluster.preset("tpu-v9")
    with pytest.raises(ConfigError, match="intra_bw"):
        paper.replace(intra_bw=0)


def test_link_class_follows_rank_formula():
    m = Mesh(axes=("dep", "row", "col"), sizes=(4, 4, 4))       # rank = k·16 + i·4 + j
    assert link_of(m, ("col",), 4) == ("intra", 0)                # 4 consecutive ranks = one node
    assert link_of(m, ("row",), 4) == ("inter", 4)                # stride 4: 4 rings share each NIC
    assert link_of(m, ("col",), 2) == ("inter", 1)
    assert link_of(m, ("row", "col"), 16) == ("intra", 0)
    assert link_of(Mesh(axes=("tp",), sizes=(64,)), ("tp",), 4) == ("inter", 1)
    c = Cluster.preset("tesseract-paper")
    ar = Comm(phase="fwd", kind="all_reduce", axes=("col",), group_size=4, buffer_bytes=1 << 20)
    t_in, link = collective_time(ar, m, c)
    assert link == "intra" and t_in == pytest.approx(6 * c.intra_latency + 1.5 * (1 << 20) / c.intra_bw)
    t_out, link = collective_time(Comm(**{**ar.__dict__, "axes": ("row",)}), m, c)
    assert link == "inter" and t_out == pytest.approx(6 * c.inter_latency + 4 * 1.5 * (1 << 20) / c.inter_bw)
    # a pipelined broadcast / reduce: p-1 latency steps, the message once over the slowest link
    assert broadcast_time(1 << 20, 4, ("col",), m, c) == pytest.approx(3 * c.intra_latency + (1 << 20) / c.intra_bw)
    assert broadcast_time(1 << 20, 4, ("row",), m, c) == pytest.approx(3 * c.inter_latency + 4 * (1 << 20) / c.inter_bw)
    assert broadcast_time(1 << 20, 1, ("row",), m, c) == 0.0


def _dense_linear_flops(cfg: dict, tokens: int) -> int:
    h, i, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i
    return 2 * tokens * (L * per_layer + h * v)


@pytest.mark.parametrize("mode,world,depth", [("1d", 2, None), ("2d", 4, None), ("2.5d", 8, 2)],
                         ids=["1d-p2", "2d-q2", "2.5d-q2d2"])
def test_estimate_flops_memory_and_time(cap, mode, world, depth):
    from autoshard.passes.pipeline import plan_captured
    from autoshard.policies import make_policy

    plan = plan_captured(cap, make_policy(mode, world, depth, 1), batch_size=B, seq_len=S)
    e = estimate(plan, "dgx-a100")
    h, heads = TINY["hidden_size"], TINY["num_attention_heads"]
    attn = TINY["num_hidden_layers"] * 4 * B * heads * S * S * (h // heads)
    assert e.flops_fwd == pytest.approx((_dense_linear_flops(TINY, B * S) + attn) / world)
    assert e.param_bytes == e.grad_bytes == plan.param_bytes_per_rank
    assert e.optimizer_bytes == 2 * plan.param_bytes_per_rank          # fp32 params: 2 fp32 moments
    assert e.activation_bytes > 0 and e.memory_bytes == (e.param_bytes * 2 + e.optimizer_bytes
                                                         + e.activation_bytes)
    assert e.comm_bytes == pytest.approx(plan.comm_bytes_per_rank())
    assert e.collective_calls == len(plan.comms())
    assert e.compute_s == pytest.approx(3 * e.flops_fwd / CLUSTERS["dgx-a100"].flops)
    assert e.step_s == pytest.approx(e.compute_s + e.comm_s) and e.comm_s > 0


def test_dp_gradient_sync_is_counted(cap):
    from autoshard.passes.pipeline import plan_captured
    from autoshard.policies import make_policy

    plan = plan_captured(cap, make_policy("1d", 4, None, 2), batch_size=B, seq_len=S)
    e = estimate(plan, "dgx-a100")
    # added by the cost model only where the plan does not sync over dp itself
    extra = sum(p.local_bytes(plan.mesh) for p in plan.params if not p.is_buffer and "dp" not in p.grad_sync)
    assert e.comm_bytes == pytest.approx(plan.comm_bytes_per_rank() + extra)   # 2(r−1)/r = 1 for r = 2
    dp_bytes = sum(t.comm.bytes_per_rank for t in e.comms if "dp" in t.comm.axes and t.node.endswith("grad sync"))
    params = sum(p.local_bytes(plan.mesh) for p in plan.params if not p.is_buffer)
    assert dp_bytes == pytest.approx(params)                          # every gradient once over dp
    assert e.activation_bytes < estimate(plan_captured(cap, make_policy("1d", 2, None, 1), batch_size=B, seq_len=S),
                                         "dgx-a100").activation_bytes   # dp halves the rows per rank


# ------------------------------------------------------------------ search

def _render(res) -> str:
    buf = io.StringIO()
    res.show(Console(file=buf, width=250))
    return buf.getvalue()


def test_search_ranks_deterministically(cap):
    a = search(cap, world_size=8, cluster="dgx-a100", batch_size=B, seq_len=S)
    b = search(cap, world_size=8, cluster="dgx-a100", batch_size=B, seq_len=S)
    assert a.to_dict() == b.to_dict() and _render(a) == _render(b)
    ranked = a.ranked
    assert [e.rank for e in ranked] == list(range(1, len(ranked) + 1))
    steps = [e.cost.step_s for e in ranked]
    assert steps == sorted(steps)
    assert a.plan is ranked[0].plan and a.plan.mesh.world_size == 8
    assert {e.candidate.mode for e in a.results} == set(POLICIES)     # 2d as [2,2] × dp2
    assert "chosen:" in _render(a)


def test_search_drops_batches_that_do_not_split(cap):
    res = search(cap, world_size=8, cluster="dgx-a100", batch_size=2, seq_len=S)
    why = {e.candidate.label: e.reason for e in res.results}
    assert "does not split" in why["2.5d [2,2,2]"]
    assert all(e.plan.batch_size == 2 for e in res.ranked)                # the global batch, as planned
    assert "does not split" in why["1d [2] × dp4"]


def _fits(cap, world, budget) -> bool:
    res = search(cap, world_size=world, cluster=Cluster.preset("cpu-gloo").replace(memory_bytes=budget),
                 batch_size=B, seq_len=S, raise_if_none=False)
    return bool(res.ranked)


def test_nothing_fits_names_smallest_world_size(cap):
    big = search(cap, world_size=1, cluster="cpu-gloo", batch_size=B, seq_len=S)
    need1 = big.best.cost.memory_bytes
    budget = int(need1 * 0.4)                                      # 1 rank cannot hold it
    with pytest.raises(ConfigError) as ei:
        search(cap, world_size=1, cluster=Cluster.preset("cpu-gloo").replace(memory_bytes=budget),
               batch_size=B, seq_len=S)
    msg = str(ei.value)
    assert "nothing fits" in msg and "smallest world size that fits is" in msg
    w = int(msg.split("smallest world size that fits is ")[1].split()[0])
    assert w > 1 and _fits(cap, w, budget)
    assert not any(_fits(cap, x, budget) for x in range(2, w))


def test_plan_auto_routes_through_search(cap):
    cfg = transformers.LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])
    p = autoshard.plan(cfg, world_size=4, mode="auto", batch_size=B, seq_len=S, cluster="dgx-a100")
    assert p.mode in POLICIES and p.mesh.world_size == 4
    ref = search(cap, world_size=4, cluster="dgx-a100", batch_size=B, seq_len=S, cp=None).best
    assert (p.mode, p.mesh) == (ref.candidate.mode, ref.candidate.mesh)


def test_cp_attention_auto_keeps_what_the_cost_model_predicts_faster(cap):
    """``cp_attention="auto"``: ring attention and gathered keys and values are both planned
    and the faster by ``estimate()`` is kept (ring on a tie); ``plan()`` records the choice,
    and the search lists both variants of a cp layout."""
    from autoshard.passes.pipeline import plan_captured
    from autoshard.planning.search import choose_cp_attention
    from autoshard.policies import make_policy

    cfg = transformers.LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])
    picked = {}
    for cluster in ("dgx-a100", "cpu-gloo"):
        steps = {a: estimate(plan_captured(cap, make_policy("1d", 4, cp=2, cp_attention=a), batch_size=2, seq_len=256),
                             cluster).step_s for a in ("ring", "gather")}
        want = "gather" if steps["gather"] < steps["ring"] else "ring"
        pol, plan = choose_cp_attention(cap, make_policy("1d", 4, cp=2, cp_attention="auto"), batch_size=2,
                                        seq_len=256, cluster=cluster)
        assert pol.cp_attention == plan.cp_attention == want, (cluster, steps)
        p = autoshard.plan(cfg, world_size=4, mode="1d", cp=2, cp_attention="auto", batch_size=2, seq_len=256,
                           cluster=cluster)
        assert p.cp_attention == want
        picked[cluster] = (want, steps)
    print("cp_attention='auto' picks:", picked)
    res = search(cap, world_size=4, cluster="dgx-a100", batch_size=1, seq_len=256, cp=2, cp_attention="auto")
    assert {"1d [2] × cp2", "1d [2] × cp2 · gathered kv"} <= {e.candidate.label for e in res.results}


def test_search_takes_context_parallel_candidates(cap):
    """``cp=None`` searches the cp size: cp candidates are planned and costed beside the
    others (their activations fall with cp); where the batch cannot split further and
    only a cp layout's activations fit the memory, the search picks it, and
    ``plan(mode="auto")`` does the same. A sequence that does not cut into a
    candidate's blocks drops it with the reason."""
    res = search(cap, world_size=4, cluster="dgx-a100", batch_size=1, seq_len=1024, cp=None)
    by = {e.candidate.label: e for e in res.results}
    assert {"1d [2] × cp2", "1d [1] × cp4"} <= set(by), sorted(by)
    cp4, tp4 = by["1d [1] × cp4"], by["1d [4]"]
    assert cp4.ok and tp4.ok and cp4.plan.mesh.cp == 4
    assert cp4.cost.activation_bytes < tp4.cost.activation_bytes
    # a memory that only the cp layouts' activations fit: the search picks one of them
    leanest = min(e.cost.memory_bytes for e in res.results if e.cost is not None and e.candidate.cp == 1)
    tight = Cluster.preset("dgx-a100").replace(memory_bytes=int(leanest * 0.99))
    small = search(cap, world_size=4, cluster=tight, batch_size=1, seq_len=1024, cp=None)
    assert small.best.candidate.cp > 1, small.best.candidate.label
    assert all(not e.ok for e in small.results if e.candidate.cp == 1)
    cfg = transformers.LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])
    p = autoshard.plan(cfg, world_size=4, mode="auto", batch_size=1, seq_len=1024, cluster=tight)
    assert p.mesh == small.best.candidate.mesh
    odd = search(cap, world_size=4, cluster="dgx-a100", batch_size=1, seq_len=1028, cp=None)
    assert "seq 1028 does not cut into 8 blocks (cp=4, balanced)" in {e.reason for e in odd.results}


# ------------------------------------------------------------------ measured overheads (issue 22)

def test_cluster_file_round_trip(tmp_path):
    c = CLUSTERS["cpu-gloo"].replace(name="measured", call_overhead=2e-4, op_overhead=3e-5, pair_overlap=0.5,
                                     flops_curve=((32, 1e9), (128, 8e9)))
    path = c.save(tmp_path / "cluster.json")
    assert Cluster.load(path) == c
    assert Cluster.preset(str(path)) == c                       # a .json path where a preset name goes
    (tmp_path / "bad.json").write_text('{"flops": 1, "warp_drive": 9}')
    with pytest.raises(ConfigError, match="warp_drive.*valid"):
        Cluster.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="call_overhead must be >= 0"):
        c.replace(call_overhead=-1.0)
    with pytest.raises(ConfigError, match="pair_overlap must be within 0-1"):
        c.replace(pair_overlap=1.5)


def test_rate_follows_the_measured_curve():
    c = CLUSTERS["cpu-gloo"].replace(flops_curve=((32, 1e9), (512, 16e9)))
    small, mid, big = (c.rate(2.0 * e ** 3) for e in (16, 128, 4096))
    assert small == 1e9 and big == 16e9
    assert 1e9 < mid < 16e9
    assert CLUSTERS["cpu-gloo"].rate(2.0 * 128 ** 3) == CLUSTERS["cpu-gloo"].flops     # no curve: flops


def test_call_and_op_overheads_enter_the_estimate(cap):
    """Each collective call pays call_overhead, each planned node op_overhead: the step
    grows by exactly calls × call_overhead + nodes × op_overhead."""
    from autoshard.passes.pipeline import plan_captured

    p = plan_captured(cap, POLICIES["1d"](Mesh(axes=("tp",), sizes=(2,))),
                                                batch_size=B, seq_len=S)
    base = CLUSTERS["cpu-gloo"]
    e0 = estimate(p, base)
    e1 = estimate(p, base.replace(call_overhead=1e-3, op_overhead=1e-5))
    nodes = sum(1 for n in p.nodes if n.kind != "input")
    assert e1.comm_s - e0.comm_s == pytest.approx(e0.collective_calls * 1e-3)
    assert e1.compute_s - e0.compute_s == pytest.approx(nodes * 1e-5)
    assert e0.collective_calls > 0 and nodes > 50


@pytest.mark.parametrize("mode,world", [("2d", 4), ("3d", 8)])
@pytest.mark.parametrize("overlap", [1.0, 0.25, 0.0])
def test_paired_collectives_are_charged_the_longer_and_what_the_pair_does_not_hide(cap, mode, world, overlap):
    """A SUMMA / 3D Linear sends its collectives of one phase and kind two at a time
    (parallel_ops.paired_collectives): the estimate charges the longer of each pair in
    full and the shorter for the share the cluster's pair_overlap does not hide (0 s
    at overlap 1, all of it at 0); every call and byte is still counted."""
    from autoshard.ir.kernels import Summa, ThreeDLinear
    from autoshard.passes.pipeline import plan_captured
    from autoshard.policies import make_policy

    cluster = CLUSTERS["cpu-gloo"].replace(pair_overlap=overlap)
    plan = plan_captured(cap, make_policy(mode, world, None, 1), batch_size=B, seq_len=S)
    e = estimate(plan, cluster)
    assert e.collective_calls == len(plan.comms())
    assert e.comm_bytes == pytest.approx(plan.comm_bytes_per_rank())
    linears = [n for n in plan.nodes if isinstance(n.kernel, (Summa, ThreeDLinear))]
    assert linears
    hidden = 0.0
    for n in linears:
        times = [t for t in e.comms if t.node == n.name]
        full = [collective_time(c, plan.mesh, cluster)[0] for c in n.comms]
        pairs = {}
        for t, f in zip(times, full):
            pairs.setdefault((t.comm.phase, t.comm.kind), []).append((t.seconds, f))
        for key, got in pairs.items():
            if len(got) == 2:       # the longer charged in full, the shorter for (1 - overlap) of it
                short, long_ = sorted(f for _, f in got)
                assert sorted(s for s, _ in got) == pytest.approx(sorted([long_, short * (1 - overlap)])), \
                    (n.name, key, got)
                hidden += short * overlap
            else:
                assert [s for s, _ in got] == [f for _, f in got], (n.name, key, got)
    unpaired = sum(collective_time(c, plan.mesh, cluster)[0] for c in plan.comms())   # + grad sync
    assert e.comm_s == pytest.approx(unpaired - hidden)
    assert (hidden > 0) == (overlap > 0)


def test_async_tp_term():
    """``estimate(async_tp=c)``: each 1d row-parallel all-reduce becomes ``c`` calls (the
    same bytes); with the overlap a cluster allows, the chunks hide behind the next
    chunk's product where they are long (a large model on cpu-gloo), and only add
    calls where nothing overlaps or the latency dominates."""
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=8, vocab_size=1024)
    plan = autoshard.plan(cfg, world_size=2, mode="1d", batch_size=8, seq_len=128)
    rows = sum(1 for n in plan.nodes if type(n.kernel).__name__ == "RowLinear")
    assert rows == 4
    base, two = estimate(plan, "cpu-gloo"), estimate(plan, "cpu-gloo", async_tp=2)
    assert two.collective_calls == base.collective_calls + rows
    assert two.comm_bytes == pytest.approx(base.comm_bytes)
    assert two.comm_s_fwd < base.comm_s_fwd and two.comm_s_bwd == base.comm_s_bwd
    assert "4 row-parallel all-reduce(s) in 2 chunks" in two.notes[-1]
    none = CLUSTERS["cpu-gloo"].replace(compute_overlap=0.0)
    assert estimate(plan, none, async_tp=2).comm_s_fwd > estimate(plan, none).comm_s_fwd
    # 1d-sp: the reduce-scatter in chunks of the batch, where each rank holds enough samples
    sp = autoshard.plan(cfg, world_size=2, mode="1d-sp", batch_size=8, seq_len=128)
    base_sp, two_sp = estimate(sp, "cpu-gloo"), estimate(sp, "cpu-gloo", async_tp=2)
    gathers = sum(1 for n in sp.nodes if n.kernel is None and n.op == "linear"       # the gather's comm sits on
                  and any(c.phase == "fwd" and c.kind == "all_gather" for c in n.comms))  # its first reader
    assert gathers == 5                                  # q and gate of each layer, the LM head
    assert two_sp.collective_calls == base_sp.collective_calls + rows + gathers
    assert two_sp.comm_bytes == pytest.approx(base_sp.comm_bytes)
    assert two_sp.comm_s_fwd < base_sp.comm_s_fwd
    assert "4 row-parallel reduce-scatter(s) and 5 sequence all-gather(s) in 2 chunks" in two_sp.notes[-1]
    one_sample = autoshard.plan(cfg, world_size=2, mode="1d-sp", batch_size=1, seq_len=128)
    assert estimate(one_sample, "cpu-gloo", async_tp=2).collective_calls == \
        estimate(one_sample, "cpu-gloo").collective_calls
    with pytest.raises(ConfigError, match="async_tp=0"):
        estimate(plan, "cpu-gloo", async_tp=0)
    with pytest.raises(ConfigError, match="compute_overlap"):
        Cluster.preset("cpu-gloo").replace(compute_overlap=1.5)


def test_search_costs_1d_with_async_tp_where_it_pays():
    """The search costs every 1d candidate with asynchronous TP too and keeps the chunk
    count the cost model prefers (``Evaluated.async_tp``; 1 where no overlap is possible)."""
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=8, vocab_size=1024,
                                   architectures=["LlamaForCausalLM"])
    res = search(cfg, world_size=2, cluster="cpu-gloo", batch_size=8, seq_len=128, modes=["1d"])
    one = next(e for e in res.ranked if e.candidate.mode == "1d")
    assert one.async_tp in (2, 4)
    assert one.cost.step_s < estimate(one.plan, "cpu-gloo").step_s
    assert res.to_dict()["candidates"][0]["async_tp"] == one.async_tp
    buf = io.StringIO()
    res.show(Console(file=buf, width=250))
    assert f"async TP ×{one.async_tp}" in buf.getvalue() and f"sharded.async_tp({one.async_tp})" in buf.getvalue()
    flat = CLUSTERS["cpu-gloo"].replace(compute_overlap=0.0)
    res0 = search(cfg, world_size=2, cluster=flat, batch_size=8, seq_len=128, modes=["1d"])
    assert next(e for e in res0.ranked if e.candidate.mode == "1d").async_tp == 1


def test_autocast_halves_the_linears_bytes_in_the_estimate():
    """``compute_dtype_bytes=2`` (bf16 autocast): SUMMA's gathers and scatters are priced at
    the compute dtype, as the kernels cast before gathering (the ledger measures ≤ 0.55× on a
    2d forward: tests/test_mixed_precision.py); the call count does not change."""
    import autoshard

    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    plan = autoshard.plan(cfg, world_size=4, mode="2d", batch_size=4, seq_len=8)
    f32, bf16 = estimate(plan, "dgx-a100"), estimate(plan, "dgx-a100", compute_dtype_bytes=2)
    assert bf16.collective_calls == f32.collective_calls
    assert bf16.comm_bytes <= 0.6 * f32.comm_bytes and bf16.comm_s_fwd < f32.comm_s_fwd
