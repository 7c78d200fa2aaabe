"""Expert parallelism (issue 60; docs/design.md, "Expert parallelism"): ``shard(mode="1d",
dp=D, ep=D)`` holds ``E / ep`` experts per rank (each split over tp as in 1d), moves the
token rows to their experts' ranks and back by all-to-all, and equals the dense model on
the global batch: loss, logits, every local gradient and 3 AdamW steps within 1e-5.

The all-to-all bytes the ledger counts are checked against the routing the dense graph
computes: every rank runs the captured (unsharded) graph on each replica's rows and
reads each expert segment's group offsets, so it knows how many rows each rank sends to
each expert, hence the bytes that leave it. The plan predicts the same calls, with bytes
under uniform routing.
"""

from __future__ import annotations

import copy

import pytest
import torch

import models
from dist_pool import get_pool

import autoshard
from autoshard.ir.errors import ConfigError


# Adam's eps in the 3-step comparisons. Adam moves a weight by lr · m / (sqrt(v) + eps); on the
# first step m / sqrt(v) = g / |g|, so a gradient that is float noise around zero moves its weight
# by up to lr whatever its size, and a difference d between two float32 sums of the same gradient
# becomes a weight difference of up to lr · d / eps. Measured (DeepSeek-V3 at ep=4, 8 ranks): one
# element of layers.0.mlp.experts.gate_up_proj has a float64 gradient of 8.7e-10; the dense float32
# model computes 5.3e-9 and the ep model -2.5e-9 (every element of that weight within 4.3e-8 of
# float64 on both: no token routed elsewhere), and torch's default eps=1e-8 turns them into steps
# of +3.4e-4 and -2.0e-4: 5.4e-4 apart, while every later gradient of that element agrees to 1e-6
# relative. float64 cannot settle it here (torch's grouped_mm, which the ep segment is found from,
# takes no float64), so the steps use eps=1e-4: a noise of 4e-8 moves a weight by at most 4e-7, and
# the weights after 3 steps are compared at the 1e-5 of the gradients.
ADAM_EPS = 1e-4


def _dense_counts(cap, inputs: dict) -> list[torch.Tensor]:
    """Per expert segment (graph order), the rows the dense graph routes to each expert
    for ``inputs``: the differences of the segment's group offsets."""
    from torch import fx

    from autoshard.passes.experts import expert_segments

    offs = [s.offs for s in expert_segments(cap.module)]
    got = {}

    class Reader(fx.Interpreter):
        def run_node(self, n):
            v = super().run_node(n)
            if n in offs:
                got[n] = v.detach().round().long()
            return v

    with torch.no_grad():
        Reader(cap.module).run(*[{**inputs, **cap.constants}[n.name] if n.name in {**inputs, **cap.constants}
                                 else None for n in cap.module.graph.nodes if n.op == "placeholder"])
    return [torch.diff(got[o], prepend=got[o].new_zeros(1)) for o in offs]


def _ep_check(rank, world, name, ep, steps, save_to=None, logits_atol=1e-5, dp=None, mode="1d"):
    from autoshard.passes.capture import capture
    from autoshard.passes.experts import count_on_floats, expert_param_rows, expert_segments, fold_grouped_weights
    from autoshard.runtime.collectives import CommLedger

    torch.set_num_threads(1)
    dp = dp or ep
    tp = world // dp
    dense = models.build(name)
    model = copy.deepcopy(dense)
    inputs = models.batch(name, b=4 * dp)
    rows = slice((rank // tp) * 4, (rank // tp + 1) * 4)
    local = {k: v[rows] for k, v in inputs.items()}
    out_d = dense(**inputs)
    out_d.loss.backward()
    sharded = autoshard.shard(model, mode=mode, dp=dp, ep=ep, example_inputs=local)
    with CommLedger() as led:
        out = sharded(**local)
        out.loss.backward()
    plan = sharded.plan
    failures = []
    cmp = models.comparer(failures)
    cmp("loss", out.loss, out_d.loss)
    try:
        torch.testing.assert_close(out.logits, out_d.logits[rows], atol=logits_atol, rtol=1e-5)
    except AssertionError as e:
        failures.append(f"logits: {str(e).splitlines()[:4]}")
    models.compare_local_grads(cmp, failures, plan, sharded, dense, rank)
    # the routing of the dense graph, per replica's rows: the bytes each rank's all-to-alls carry
    cap = count_on_floats(fold_grouped_weights(capture(copy.deepcopy(dense), example_inputs=local)))
    counts = [_dense_counts(cap, {k: v[slice(d * 4, d * 4 + 4)] for k, v in inputs.items()}) for d in range(dp)]
    me = rank // tp
    # the ep group: the dp ranks d with the same d % (dp/ep) (docs/design.md, "Expert parallelism"),
    # d // (dp/ep) the block of experts d holds
    copies = dp // ep
    peers = [d for d in range(dp) if d % copies == me % copies and d != me]
    expect = 0
    segs = expert_segments(cap.module)
    for layer, seg in enumerate(segs):
        e = counts[0][layer].numel()
        block, per = me // copies, -(-e // ep)      # per rank: ceil(e / ep) experts, the last zero-padded
        mine = slice(block * per, (block + 1) * per)
        sent = int(counts[me][layer].sum() - counts[me][layer][mine].sum())
        came = sum(int(counts[d][layer][mine].sum()) for d in peers)
        # a row's bytes: the hidden state out (and back) -- plus, where the model gathers a per-row
        # value from outside the experts other than a per-expert parameter's row (which the owner
        # gathers from its block: gpt-oss's gate_up bias), its tp block
        hidden = dense.config.hidden_size * 4
        extra = sum(v.meta["val"].shape[-1] * 4 // tp for v in seg.rows[1:] if expert_param_rows(seg, v) is None)
        # counts; rows out (sent) and results back (came) in forward, the reverse for their gradients
        expect += (ep - 1) * per * 8 + (sent + came) * (2 * hidden + extra)
    a2a = [c for c in led.calls if c.kind == "all_to_all"]
    res = {"failures": failures, "a2a_calls": len(a2a), "a2a_bytes": sum(c.buffer_bytes for c in a2a),
           "expected_a2a_bytes": expect, "ledger_calls": led.count(), "plan_calls": len(plan.comms()),
           "plan_a2a": len([c for c in plan.comms() if c.kind == "all_to_all"]),
           # the experts' weights (3-D: one matrix per expert); gpt-oss's per-expert biases stay whole
           "expert_bytes": sum(p.numel() * p.element_size() for n, p in sharded.named_parameters()
                               if ".experts." in n and p.dim() == 3),
           "dense_expert_bytes": sum(p.numel() * p.element_size() for n, p in dense.named_parameters()
                                     if ".experts." in n and p.dim() == 3),
           # the experts' count padded to a multiple of ep (ep · ceil(E / ep)) over the dense one
           "expert_pad": (-(-dense.config.num_local_experts // ep) * ep, dense.config.num_local_experts)
           if hasattr(dense.config, "num_local_experts") else (1, 1),
           # per-expert biases (gpt-oss): the gate_up bias, gathered by expert id, split over ep
           # (whole over tp); the down bias, added after the combine, whole
           "bias_bytes": {n: (p.numel() * p.element_size(), dict(dense.named_parameters())[n].numel() * p.element_size())
                          for n, p in sharded.named_parameters() if ".experts." in n and p.dim() == 2},
           "tp": tp, "param_bytes": sum(p.numel() * p.element_size() for p in sharded.parameters()),
           "plan_param_bytes": plan.param_bytes_per_rank}
    # the experts reassemble whole under their Hugging Face names (rank 0 gathers), and a saved
    # folder loads in transformers with the dense weights
    full = sharded.full_state_dict()
    if save_to is not None:
        sharded.save_pretrained(save_to)
    if rank == 0:
        ref = dense.state_dict()
        for k, v in full.items():
            if not torch.equal(v, ref[k]):
                failures.append(f"full_state_dict[{k}] differs from dense")
        if set(full) != set(ref):
            failures.append(f"full_state_dict names: {sorted(set(full) ^ set(ref))[:4]}")
        if save_to is not None:
            import transformers

            back = getattr(transformers, type(dense).__name__).from_pretrained(save_to).state_dict()
            bad = [k for k in ref if k not in back or not torch.equal(back[k], ref[k])]
            if bad:
                failures.append(f"save_pretrained -> from_pretrained differs: {bad[:4]}")
    if save_to is not None:     # the folder loads into an ep layout: each rank reads its experts
        again = autoshard.shard(save_to, mode="1d", dp=dp, ep=ep, example_inputs=local)
        with torch.no_grad():
            try:
                torch.testing.assert_close(again(**local).logits, sharded(**local).logits, atol=0, rtol=0)
            except AssertionError as e:
                failures.append(f"loaded at ep={ep}: {str(e).splitlines()[:3]}")
    if steps:
        losses = {"sharded": [], "dense": []}
        for key, m, batch in (("sharded", sharded, local), ("dense", dense, inputs)):
            m.zero_grad()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3, eps=ADAM_EPS)
            for _ in range(steps):
                opt.zero_grad()
                loss = m(**batch).loss
                loss.backward()
                opt.step()
                losses[key].append(loss.item())
        res["losses"] = losses
        # the weights after the steps, within 1e-5 (ADAM_EPS says why Adam's eps is 1e-4 here)
        dparams = dict(dense.named_parameters(remove_duplicate=False))
        sparams = dict(sharded.named_parameters(remove_duplicate=False))
        res["step_param_diff"] = 0.0
        for pp in plan.params:
            want = pp.spec.local(pp.pad(dparams[pp.name].detach()), plan.mesh, rank)
            res["step_param_diff"] = max(res["step_param_diff"], (sparams[pp.name].detach() - want).abs().max().item())
            try:
                torch.testing.assert_close(sparams[pp.name].detach(), want, atol=1e-5, rtol=1e-5)
            except AssertionError as e:
                failures.append(f"after {steps} steps: {pp.name}: {str(e).splitlines()[:4]}")
    return res


def _assert_exact(results, ep):
    r0 = results[0]
    print(f"ep={ep}: rank 0 all-to-all {r0['a2a_calls']} calls {r0['a2a_bytes']} B (dense routing "
          f"{r0['expected_a2a_bytes']} B), expert bytes {r0['expert_bytes']} of {r0['dense_expert_bytes']}, "
          f"losses {r0.get('losses')}, weights after the steps within {max(r.get('step_param_diff', 0) for r in results):.2e}")
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: {r['failures'][:6]}"
        assert r["ledger_calls"] == r["plan_calls"], (r["ledger_calls"], r["plan_calls"])
        assert r["a2a_calls"] == r["plan_a2a"] > 0
        assert r["a2a_bytes"] == r["expected_a2a_bytes"], (rank, r["a2a_bytes"], r["expected_a2a_bytes"])
        assert r["param_bytes"] == r["plan_param_bytes"]
        # each rank: E/ep experts, each split over tp
        padded, experts = r["expert_pad"]
        assert r["expert_bytes"] * ep * r["tp"] * experts == r["dense_expert_bytes"] * padded, \
            (r["expert_bytes"], r["dense_expert_bytes"], padded, experts)
        for name, (mine, whole) in r["bias_bytes"].items():
            assert mine * (ep if "gate_up" in name else 1) == whole, (name, mine, whole)
        if "losses" in r:
            for a, b in zip(r["losses"]["sharded"], r["losses"]["dense"]):
                assert abs(a - b) <= 1e-5, r["losses"]


@pytest.mark.extended
def test_mixtral_ep2_equals_dense(tmp_path):
    """Mixtral at ep=2 on 4 ranks (tp2 × dp2): exact, 3 AdamW steps exact, the all-to-all
    bytes those of the dense routing, the experts' bytes per rank dense / (ep · tp); the
    experts reassemble (full_state_dict, save_pretrained -> transformers)."""
    _assert_exact(get_pool(4, timeout=600).run(_ep_check, "mixtral", 2, 3, str(tmp_path / "saved")), 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3moe", "olmoe", "deepseekv3", "gptoss"])
def test_moe_ep2_equals_dense(name):
    """Qwen3-MoE, OLMoE, DeepSeek-V3 (a shared expert beside the routed ones) and gpt-oss
    (experts with biases, gathered per row by expert id and moved with the rows) at ep=2."""
    # gpt-oss's logits on the second replica's rows differ from dense by 1.1e-5 in one element of
    # 4096 with expert-TP (ep=1) as well, bit for bit the same as here: float noise of the model
    # at dp=2 (its 1d plan), not of the dispatch; its gradients are within 1e-5
    _assert_exact(get_pool(4, timeout=600).run(_ep_check, name, 2, 3, None, 2e-5 if name == "gptoss" else 1e-5), 2)


@pytest.mark.extended
@pytest.mark.parametrize("name", ["mixtral", "qwen3moe", "olmoe", "deepseekv3", "gptoss"])
def test_moe_ep4_on_8_ranks(name):
    """ep=4 on 8 ranks (tp2 × dp4): each rank holds a quarter of the experts (one of
    Mixtral's 4), exact against dense on the global batch, 3 AdamW steps exact, the
    ledger's all-to-all bytes those of the dense routing."""
    _assert_exact(get_pool(8, timeout=900).run(_ep_check, name, 4, 3, None, 2e-5 if name == "gptoss" else 1e-5), 4)


@pytest.mark.extended
def test_mixtral_ep2_of_dp4(tmp_path):
    """ep=2 below dp=4 (4 ranks, tp1): each pair of experts is held by 2 consecutive dp ranks, the
    ep groups are the ranks 2 apart (0, 2 and 1, 3), the experts' gradients summed over each
    pair: exact against dense, 3 AdamW steps exact, the all-to-all bytes those of the dense
    routing within each group, half the experts' bytes per rank; the experts save under their
    Hugging Face names (and load in transformers) and load back at ep=2."""
    _assert_exact(get_pool(4, timeout=600).run(_ep_check, "mixtral", 2, 3, str(tmp_path / "saved"), 1e-5, 4), 2)


@pytest.mark.extended
def test_gptoss_ep2_of_dp4():
    """gpt-oss at ep=2 below dp=4 (4 ranks, tp1): its gate_up bias, split over ep like the experts,
    is held in the copies layout too (each block of 2 experts' biases on 2 ranks, their gradients
    summed by the copies' all-reduce): exact against dense, 3 AdamW steps exact."""
    _assert_exact(get_pool(4, timeout=600).run(_ep_check, "gptoss", 2, 3, None, 2e-5, 4), 2)


@pytest.mark.extended
def test_auto_with_a_pinned_ep():
    """shard(mode="auto", dp=2, ep=2) on 4 ranks: the search keeps the 1d layouts with ep=2
    (check_ep no longer refuses "auto") and the module is the ep one: exact against dense, the
    all-to-all bytes those of the dense routing."""
    results = get_pool(4, timeout=600).run(_ep_check, "mixtral", 2, 0, None, 1e-5, 2, "auto")
    _assert_exact(results, 2)


@pytest.mark.parametrize("kw,needle", [
    (dict(mode="1d", dp=4, ep=3), "ep=3 must divide dp × cp = 4 (the ranks expert parallelism borrows); valid ep: 1, 2, 4"),
    (dict(mode="1d", dp=6, ep=4), "valid ep: 1, 2, 3, 6"),
    (dict(mode="2d", dp=2, ep=2), "composes with mode='1d' only today"),
    (dict(mode="1d", dp=2, ep=0), "ep=0 must be a positive integer"),
    (dict(mode="1d", dp=2, ep=2, fsdp=True), "fsdp=True is not implemented yet"),
])
def test_bad_ep_raises_before_any_collective(kw, needle):
    """A bad ``ep`` raises a ConfigError naming the valid choices before the process
    group is even joined (no process group exists in this test process)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="ep") as e:
        autoshard.shard(torch.nn.Linear(2, 2), **kw)
    assert needle in str(e.value)
    assert not dist.is_initialized()


def test_plan_shows_the_all_to_alls():
    """The plan of Mixtral at ep=2 (dp2 × tp2): each expert weight split over dp on the
    expert dim and over tp as in 1d, no dp gradient sync for it; per MoE layer, the counts
    exchange, the rows out and the results back in forward and the two reverse exchanges
    in backward, at the bytes of uniform routing (half the local rows leave the rank)."""
    p = autoshard.plan(models.build("mixtral"), world_size=4, mode="1d", dp=2, ep=2, batch_size=8, seq_len=8,
                       example_inputs=models.batch("mixtral"))
    experts = [pp for pp in p.params if ".experts." in pp.name]
    assert experts and all(pp.spec.dims[0] == ("dp",) and "tp" in pp.spec.axes and pp.grad_sync == ()
                           for pp in experts), [(pp.name, pp.spec, pp.grad_sync) for pp in experts]
    a2a = [c for c in p.comms() if c.kind == "all_to_all"]
    rows, hidden = 8 * 8 * 2 // 2, 64 * 4          # the rank's routed rows (top-2 of its 4×8 tokens), a row's bytes
    assert sorted((c.phase, c.buffer_bytes) for c in a2a) == sorted(
        [("fwd", 2 * 8)] * 2 + [("fwd", rows // 2 * hidden)] * 4 + [("bwd", rows // 2 * hidden)] * 4)
    assert all(c.axes == ("dp",) and c.group_size == 2 for c in a2a)
    from autoshard.planning.cost import CLUSTERS, collective_time, estimate

    # the cost model prices them like any collective (p-1 latency steps, the bytes sent), and
    # adds no dp all-reduce for the experts split over dp
    e = estimate(p, "dgx-a100")
    assert e.collective_calls == len(p.comms()) + len([q for q in p.params if "dp" not in q.grad_sync
                                                       and "dp" not in q.spec.axes and q.trainable])
    assert all(collective_time(c, p.mesh, CLUSTERS["dgx-a100"])[0] > 0 for c in a2a)


def _ep_remat(rank, world, dp, ep):
    from autoshard.runtime.collectives import CommLedger

    torch.set_num_threads(1)
    tp = world // dp
    dense = models.build("mixtral")
    inputs = models.batch("mixtral", b=4 * dp)
    rows = slice((rank // tp) * 4, (rank // tp + 1) * 4)
    local = {k: v[rows] for k, v in inputs.items()}
    out_d = dense(**inputs)
    out_d.loss.backward()
    sharded = autoshard.shard(copy.deepcopy(dense), mode="1d", dp=dp, ep=ep, example_inputs=local,
                              activation_checkpointing=True)
    blocks = sum(1 for n, _ in sharded.graph_module().named_children() if n.startswith("_remat_"))
    with CommLedger() as led:
        out = sharded(**local)
        out.loss.backward()
    failures = []
    cmp = models.comparer(failures)
    cmp("loss", out.loss, out_d.loss)
    cmp("logits", out.logits, out_d.logits[rows])
    models.compare_local_grads(cmp, failures, sharded.plan, sharded, dense, rank)
    a2a = [c for c in sharded.plan.comms() if c.kind == "all_to_all"]
    return {"failures": failures, "blocks": blocks, "a2a": sum(c.kind == "all_to_all" for c in led.calls),
            "plan_a2a": len(a2a), "plan_a2a_fwd": sum(c.phase == "fwd" for c in a2a)}


@pytest.mark.extended
@pytest.mark.parametrize("dp,ep", [(2, 2), (4, 2)])
def test_ep_with_activation_checkpointing(dp, ep):
    """activation_checkpointing=True with ep (4 ranks: tp2 × dp2 at ep=2, tp1 × dp4 at ep=2):
    each decoder layer recomputes in backward, its dispatch and combine with it (the ledger
    holds the plan's all-to-alls plus the forward ones once more), and the loss, logits and
    every local gradient equal dense's."""
    for rank, r in enumerate(get_pool(4, timeout=600).run(_ep_remat, dp, ep)):
        assert r["failures"] == [], (rank, r["failures"][:6])
        assert r["blocks"] == 2, r
        assert r["a2a"] == r["plan_a2a"] + r["plan_a2a_fwd"], r


def _lora_check(rank, world, dense, *, dp, **kw):
    """:func:`models.check_trainable` of the peft model ``dense`` (its LoRA B set non-zero, so
    the adapters change the output) sharded in 1d with ``dp`` replicas of 4 rows each."""
    torch.set_num_threads(1)
    with torch.no_grad():
        torch.manual_seed(1)
        for n, p in dense.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    dense.train()
    res, sharded, _ = models.check_trainable(
        rank, world, dense, copy.deepcopy(dense), models.batch("mixtral", b=4 * dp), mode="1d", dp=dp,
        dense_params=dict(dense.get_base_model().named_parameters(remove_duplicate=False)), **kw)
    return res, sharded


def _ep_lora(rank, world):
    import peft

    dense = peft.get_peft_model(models.build("mixtral"), peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                                                        target_modules=["q_proj", "v_proj"]))
    res, sharded = _lora_check(rank, world, dense, dp=2, ep=2)
    res["experts"] = [(pp.spec.dims[0], pp.trainable) for pp in sharded.plan.params if ".experts." in pp.name]
    res["a2a"] = len([c for c in sharded.plan.comms() if c.kind == "all_to_all"])
    return res


@pytest.mark.extended
def test_ep_with_lora():
    """shard(peft model) with ep=2 (tp2 × dp2): LoRA on the attention's q and v, the experts
    frozen and split over dp: the rows still travel both ways (their gradient flows to the
    adapters below), and the loss, logits and every adapter's local gradient equal dense
    peft's; the frozen experts get no gradient and no sync; the ledger holds the plan's calls."""
    for rank, r in enumerate(get_pool(4, timeout=600).run(_ep_lora)):
        assert r["failures"] == [], (rank, r["failures"][:6])
        assert r["experts"] and all(e == (("dp",), False) for e in r["experts"]), r["experts"]
        assert r["a2a"] == 2 * 5 and r["ledger"]["fwd"][0] == r["plan"]["fwd"][0], r
        assert r["ledger"]["bwd"][0] == r["plan"]["bwd"][0], r


def test_plan_ep_below_dp():
    """ep=2 of dp=4 (tp1): each expert weight is written as 2 blocks of 2 experts held in 2
    copies each (E · 2 rows split 4 ways: a rank holds 2 experts), its gradient summed over
    the 2 ranks holding the same block (one all-reduce per weight, group of 2) instead of over
    dp; the all-to-alls run in groups of 2."""
    p = autoshard.plan(models.build("mixtral"), world_size=4, mode="1d", dp=4, ep=2, batch_size=8, seq_len=8,
                       example_inputs=models.batch("mixtral"))
    experts = [pp for pp in p.params if ".experts." in pp.name]
    assert len(experts) == 4
    for pp in experts:
        assert (pp.global_shape[0], pp.hf_shape[0], pp.pad_segments, pp.pad_copies) == (8, 4, 2, 2), pp
        assert pp.spec.dims[0] == ("dp",) and pp.grad_sync == () and pp.copy_group(p.mesh) == 2
        assert pp.local_shape(p.mesh)[0] == 2
    sums = p.copy_sync_comms()
    assert sorted(c.buffer_bytes for c in sums) == sorted(pp.local_bytes(p.mesh) for pp in experts)
    assert all(c.group_size == 2 and c.axes == ("dp",) for c in sums)
    a2a = [c for c in p.comms() if c.kind == "all_to_all"]
    assert len(a2a) == 2 * 5 and all(c.group_size == 2 for c in a2a)
    # a block of experts and its copies: the 2 blocks of each weight, each twice, in rank order
    w = torch.arange(4.0).view(4, 1, 1).expand(4, 256, 64)
    assert [experts[0].spec.local(experts[0].pad(w), p.mesh, r)[:, 0, 0].tolist() for r in range(4)] == \
        [[0, 1], [0, 1], [2, 3], [2, 3]]


def _generate(rank, world, name):
    from autoshard.runtime.collectives import CommLedger

    torch.set_num_threads(1)
    dense = models.build(name).eval()
    ids = models.batch(name, b=4)["input_ids"]
    mine = ids[2 * (rank // 2): 2 * (rank // 2) + 2]         # this replica's prompts
    sharded = autoshard.shard(copy.deepcopy(dense), mode="1d", dp=2, ep=2, example_inputs={"input_ids": mine})
    with CommLedger() as led:
        out = sharded.generate(mine, max_new_tokens=3, do_sample=False)
    ref = dense.generate(mine, max_new_tokens=3, do_sample=False)
    return torch.equal(out, ref), sum(c.kind == "all_to_all" for c in led.calls)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "gptoss", pytest.param("mixtral-e3", marks=pytest.mark.extended)])
def test_generate_with_ep(name):
    """generate() on a module sharded with ep=2: the prefill and decode steps are planned with
    the module's layouts (experts split over dp; gpt-oss's gate_up bias too) and dispatch their
    tokens to the experts' ranks; greedy tokens equal dense generate()'s."""
    for same, a2a in get_pool(4, timeout=600).run(_generate, name):
        assert same and a2a > 0


def _lora_on_experts(model):
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=[
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))


@pytest.mark.slow      # two plans: ~10 s of CPU
def test_lora_on_the_experts_refused_naming_the_choices():
    """LoRA on the expert weights themselves (peft's ``target_parameters``) with the batch
    split (dp=2, ep=2 and ep=1): each expert's weight is ``W + B @ A`` computed in the graph, so
    the grouped matmul is not folded to a parameter-operand ``grouped_linear`` and meets the
    rank-locally sorted rows. A ShardingError names the grouped matmul, its computed weight and
    the parameters it is computed from, and the valid choices."""
    from autoshard.ir.errors import ShardingError

    base = _lora_on_experts(models.build("mixtral")).get_base_model()
    for ep in (2, 1):
        with pytest.raises(ShardingError) as e:
            autoshard.plan(base, world_size=4, mode="1d", dp=2, ep=ep, batch_size=8, seq_len=8,
                           example_inputs=models.batch("mixtral"))
        msg = str(e.value)
        assert "grouped_mm" in msg and "layers.0.mlp.experts.base_layer.lora_A.default.weight" in msg, msg
        assert "Valid choices: LoRA on the attention and dense layers (peft target_modules)" in msg, msg
        assert "no batch split (dp=1, cp=1, ep=1)" in msg, msg


def _lora_experts_dp1(rank, world):
    return _lora_check(rank, world, _lora_on_experts(models.build("mixtral")), dp=1)[0]


@pytest.mark.slow
def test_lora_on_the_experts_without_a_batch_split():
    """The refusal's last valid choice holds: LoRA on the expert weights at dp=1 (2 ranks, tp2,
    expert-TP) equals dense peft (loss, logits, every adapter's local gradient)."""
    for rank, r in enumerate(get_pool(2, timeout=600).run(_lora_experts_dp1)):
        assert r["failures"] == [], (rank, r["failures"][:6])


@pytest.mark.slow
@pytest.mark.parametrize("name,ep,dp", [("mixtral-e3", 2, 2),
                                        pytest.param("mixtral-e6", 4, 4, marks=pytest.mark.extended)])
def test_expert_count_ep_does_not_divide(name, ep, dp, tmp_path):
    """3 experts at ep=2 (tp2 × dp2) and 6 at ep=4 (tp1 × dp4), 4 ranks (issue 59): the experts
    zero-padded to ep · ceil(E / ep) (2 per rank; the last rank's second, or the fourth rank's
    both, padded ones the router never picks): exact against dense, 3 AdamW steps exact, the
    all-to-all bytes those of the dense routing, full_state_dict the dense experts (unpadded), saved
    under their Hugging Face shapes (loading in transformers) and loaded back at the same ep."""
    _assert_exact(get_pool(4, timeout=600).run(_ep_check, name, ep, 3, str(tmp_path / "saved"), 1e-5, dp), ep)


def test_plan_pads_experts_ep_does_not_divide():
    """6 experts at ep=4 (dp4, tp1; issue 59): each expert weight zero-padded to 8 experts, 2 per
    rank (the fourth rank's both padded), no copies; the counts exchange carries 2 integers per
    peer; the padding holds zeros and trims back to the Hugging Face shape."""
    p = autoshard.plan(models.build("mixtral-e6"), world_size=4, mode="1d", dp=4, ep=4, batch_size=8, seq_len=8,
                       example_inputs=models.batch("mixtral-e6"))
    experts = [pp for pp in p.params if ".experts." in pp.name]
    assert len(experts) == 4
    for pp in experts:
        assert (pp.global_shape[0], pp.hf_shape[0], pp.pad_copies) == (8, 6, 0), pp
        assert pp.spec.dims[0] == ("dp",) and pp.grad_sync == () and pp.local_shape(p.mesh)[0] == 2
    w = torch.arange(1.0, 7.0).view(6, 1, 1).expand(6, *experts[0].hf_shape[1:])
    assert [experts[0].spec.local(experts[0].pad(w), p.mesh, r)[:, 0, 0].tolist() for r in range(4)] == \
        [[1, 2], [3, 4], [5, 6], [0, 0]]
    assert torch.equal(experts[0].trim(experts[0].pad(w)), w)
    a2a = [c for c in p.comms() if c.kind == "all_to_all"]
    assert sorted(c.buffer_bytes for c in a2a)[:2] == [3 * 2 * 8] * 2      # (ep - 1) peers × 2 counts × int64


def test_uneven_experts_below_dp_refused_naming_the_choices():
    """3 experts at ep=2 of dp=4: the blocks would be held in copies, which the zero-padding does not
    compose with yet: a ConfigError at planning naming the valid ep and expert-TP (ep=1)."""
    with pytest.raises(ConfigError) as e:
        autoshard.plan(models.build("mixtral-e3"), world_size=4, mode="1d", dp=4, ep=2, batch_size=8, seq_len=8,
                       example_inputs=models.batch("mixtral-e3"))
    msg = str(e.value)
    assert "ep=2 does not divide the 3 experts" in msg and "valid ep: [1, 4]" in msg, msg
    assert "expert-TP, ep=1, takes any expert count" in msg, msg
