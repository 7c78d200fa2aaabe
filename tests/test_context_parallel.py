"""Context parallelism (``cp=``): the sequence split over a ``cp`` mesh axis from the
token lookups to the loss, attention with its queries split and its keys and values
either sent around the cp ring (``cp_attention="ring"``, the default) or gathered over
``cp`` (``"gather"``). Sharded vs dense on gloo CPU ranks: logits, loss and every local
gradient within atol = rtol = 1e-5, parameter bytes and the collective ledger equal
to the plan, and no fallback (no op that gathered the sequence back)."""

from __future__ import annotations

import pytest
import torch

import models
from dist_pool import get_pool

EXT = pytest.mark.extended      # the other cells of the matrix: `make test-extended` (the suite's 15 minutes)
CASES = [
    # (model, world, mode, cp, attention): cp alone, with tp = 2, with 2d's q = 2 grid
    *[(m, 2, "1d", 2, "ring") for m in ("llama", "gpt2", "bert")],
    ("llama", 4, "1d", 2, "ring"),
    pytest.param(("gpt2", 4, "1d", 4, "ring"), marks=EXT), pytest.param(("llama", 4, "1d", 2, "gather"), marks=EXT),
    *[pytest.param((m, 2, "1d", 2, "gather"), marks=EXT) for m in ("llama", "gpt2", "bert")],
    *[pytest.param((m, 4, "1d", 2, a), marks=EXT) for m in ("gpt2", "bert") for a in ("ring", "gather")],
    *[pytest.param((m, 4, "1d", 4, a), marks=EXT) for m in ("llama", "bert") for a in ("ring", "gather")],
    pytest.param(("gpt2", 4, "1d", 4, "gather"), marks=EXT),
    *[pytest.param((m, 8, "1d", 4, a), marks=EXT) for m in ("llama", "gpt2", "bert") for a in ("ring", "gather")],
    *[pytest.param((m, 8, "2d", 2, a), marks=EXT) for m in ("gpt2", "bert") for a in ("ring", "gather")],
    pytest.param(("llama", 8, "2d", 2, "ring"), marks=pytest.mark.slow),
    pytest.param(("llama", 8, "2d", 2, "gather"), marks=EXT),
    # a learned float mask (T5's relative position bias) gets its gradient through the ring
    pytest.param(("t5", 2, "1d", 2, "ring"), marks=EXT),
    # 2.5d (d = 2, q = 2) × cp2: 16 ranks
    pytest.param(("llama", 16, "2.5d", 2, "ring"), marks=EXT),
]


def _assert_exact(res: list[dict], attention: str = "ring", balanced: bool = True, layers: int = 2) -> None:
    for rank, r in enumerate(res):
        assert r["balanced"] == balanced, (rank, "the cp group's order")
        assert not r["failures"], f"rank {rank}: {r['failures']}"
        assert r["ledger_bytes"] == r["plan_bytes"] and r["ledger_calls"] == r["plan_calls"], (rank, r)
        assert r["param_bytes"] == r["plan_param_bytes"], (rank, r)
        assert r["fallbacks"] == [], (rank, r["fallbacks"])
        # the split really holds: values laid out on cp, and every attention (of ``layers``) keeps it
        assert r["cp_nodes"] > 10, (rank, r["cp_nodes"])
        if attention == "ring":
            assert r["ring_attention"] >= layers and r["sdpa_cp_gathers"] == 0, (rank, r)
        else:
            assert r["ring_attention"] == 0 and r["sdpa_cp_gathers"] >= 2 * layers, (rank, r)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[2]}-w{c[1]}-cp{c[3]}-{c[4]}")
def test_context_parallel_equals_dense(case):
    name, world, mode, cp, attention = case
    res = get_pool(world, timeout=900).run(models.check, name, mode, cp=cp, share_capture=True, cp_attention=attention,
                                           depth=2 if mode == "2.5d" else None)
    _assert_exact(res, attention)
    if mode == "2d":        # the batch split stays (2 blocks of rows), cp cuts each block's sequence
        assert all(r["batch_split"] == 2 for r in res)


@EXT
def test_contiguous_order_equals_dense():
    """``cp_order="contiguous"`` (rank r holds block r, the sequence a multiple of cp only):
    exact too; under Llama's causal mask rank 0 computes fewer attention scores than rank 1."""
    res = get_pool(2).run(models.check, "llama", "1d", cp=2, share_capture=True, cp_order="contiguous")
    _assert_exact(res, balanced=False)
    assert res[0]["ring_scores"] < res[1]["ring_scores"], [r["ring_scores"] for r in res]


@EXT
def test_balanced_order_gives_every_rank_the_same_causal_work():
    """Llama at cp4 (seq 16): in the balanced order every rank computes the same number of
    attention scores, the blocks the causal mask hides being skipped; in the contiguous
    order the last rank computes the most (rank 0: one block of four)."""
    bal = get_pool(4).run(models.check, "llama", "1d", cp=4, share_capture=True, seq=16)
    con = get_pool(4).run(models.check, "llama", "1d", cp=4, share_capture=True, seq=16, cp_order="contiguous")
    _assert_exact(bal)
    _assert_exact(con, balanced=False)
    b, c = [r["ring_scores"] for r in bal], [r["ring_scores"] for r in con]
    assert len(set(b)) == 1 and c == sorted(c) and c[0] < c[-1], (b, c)
    assert b[0] < max(c), (b, c)        # the slowest rank's work falls
    print(f"attention scores per rank at cp4: balanced {b}, contiguous {c}")


def test_auto_with_cp_searches_the_layouts_that_take_it():
    """``shard(mode="auto", cp=2)`` on 2 ranks: the search keeps cp = 2 (the one layout,
    ``1d [1] × cp2``) and the module is exact."""
    res = get_pool(2).run(models.check, "llama", "auto", cp=2, share_capture=True)
    _assert_exact(res)


@pytest.mark.parametrize("world,cp,seq,order", [
    (2, 2, 8, "balanced"),
    pytest.param(4, 4, 16, "balanced", marks=EXT), pytest.param(4, 2, 8, "contiguous", marks=EXT)],
    ids=["cp2", "cp4-seq16", "tp2-cp2-contiguous"])
def test_convolution_along_the_sequence_exchanges_its_halo(world, cp, seq, order):
    """LFM2's causal convolution over the tokens (padded both ends, the first S kept:
    ``passes/token_fold.py`` makes it ``ir.tokens.sequence_conv``) keeps the cp split: each
    block takes the 2 rows before it from the block that holds them (one all-gather of
    every block's edge rows, their gradients reduce-scattered home), in either order;
    exact, ledger = plan, the gathered buffer every block's 2 edge rows of 4 sequences × 64
    channels."""
    res = get_pool(world).run(models.check, "lfm2", "1d", cp=cp, seq=seq, cp_order=order)
    _assert_exact(res, balanced=order == "balanced", layers=1)     # a conv layer, then an attention layer
    for r in res:
        assert r["halo"] == [(2, 0, ("cp",))], r["halo"]
        blocks = cp * (2 if order == "balanced" else 1)
        edges = 4 * 64 * 2 * blocks * 4
        assert r["halo_buffers"] == [("all_gather", edges), ("reduce_scatter", edges)], r["halo_buffers"]
        assert r["min_seq"] == 2 * cp * (2 if order == "balanced" else 1)


def test_with_dp():
    """dp2 × cp2 (tp 1): each replica its own rows, each row's sequence split over cp."""
    _assert_exact(get_pool(4).run(models.check, "llama", "1d", cp=2, dp=2, share_capture=True))


def _saved(rank: int, world: int, cp: int, seq: int, attention: str) -> tuple[int, int]:
    import autoshard
    from autoshard.planning.activations import SavedBytes, saved_bytes

    torch.set_num_threads(1)
    model = models.build("llama")
    inputs = models.batch("llama", b=2, s=seq)
    sharded = autoshard.shard(model, mode="1d", cp=cp, cp_attention=attention, example_inputs=inputs)
    with SavedBytes(sharded.parameters()) as m:
        sharded(**inputs)
    return m.nbytes, saved_bytes(sharded.plan, "cpu")


def test_saved_activations_equal_the_plans_trace():
    """What a rank saves for backward (``saved_tensors_hooks``), to the byte, at cp 2
    (tp 1, ring and gathered attention) and at cp 1 (tp 2) on the same 2 ranks; the
    ratios are printed. The ring saves less than the gather: no rank keeps the whole
    keys and values."""
    runs = {(cp, a): get_pool(2).run(_saved, cp, 32, a) for cp, a in ((1, "ring"), (2, "ring"), (2, "gather"))}
    for key, res in runs.items():
        for measured, predicted in res:
            assert measured == predicted, (key, measured, predicted)
    base = runs[(1, "ring")][0][0]
    ring, gather = runs[(2, "ring")][0][0] / base, runs[(2, "gather")][0][0] / base
    print(f"saved activations per rank at seq 32, vs tp2: cp2 ring {ring:.3f}, cp2 gather {gather:.3f}")
    assert ring < gather < 0.95


def test_bad_cp_and_sequence_lengths_are_refused_naming_the_valid_choices():
    import transformers

    import autoshard
    from autoshard.ir.errors import ConfigError

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    with pytest.raises(ConfigError, match=r"cp=3 × dp=1 must divide the world size 4; valid cp: \[1, 2, 4\]"):
        autoshard.plan(cfg, world_size=4, mode="1d", cp=3, batch_size=4, seq_len=12)
    with pytest.raises(ConfigError, match=r"mode='3d' does not take cp yet: .*valid with cp: '1d', '2d', '2.5d'$"):
        autoshard.plan(cfg, world_size=16, mode="3d", cp=2, batch_size=4, seq_len=8)
    with pytest.raises(ConfigError, match="seq_len"):
        autoshard.plan(cfg, world_size=4, mode="1d", cp=2, batch_size=4, seq_len=7)
    # the balanced order cuts 2·cp chunks: the valid lengths and the contiguous order named
    with pytest.raises(ConfigError, match=r"sequence length 12 of seq_len is not divisible by the sequence split 8 "
                                          r"\(cp=4 in the balanced order cuts it into 2·cp=8 chunks; "
                                          r"cp_order='contiguous' needs a multiple of 4 only\); valid lengths are the "
                                          r"multiples of 8 \(8 or 16 near 12\)"):
        autoshard.plan(cfg, world_size=4, mode="1d", cp=4, batch_size=4, seq_len=12)
    assert autoshard.plan(cfg, world_size=4, mode="1d", cp=4, batch_size=4, seq_len=12,
                          cp_order="contiguous").cp_order == "contiguous"
    with pytest.raises(ConfigError, match=r"sequence length 8 of seq_len is shorter than 16: a convolution along the "
                                          r"sequence reaches 2 row\(s\) past the edge of each of its 8 cp blocks"):
        autoshard.plan(models.build("lfm2"), world_size=4, mode="1d", cp=4, batch_size=4, seq_len=8)
    with pytest.raises(ConfigError, match=r"cp_order='zigzag'; valid: 'balanced', 'contiguous'"):
        autoshard.plan(cfg, world_size=4, mode="1d", cp=2, batch_size=4, seq_len=8, cp_order="zigzag")
    p = autoshard.plan(cfg, world_size=8, mode="1d", cp=2, dp=2, batch_size=4, seq_len=16)
    assert p.mesh.axes == ("dp", "cp", "tp") and p.tp_size == 2
    # every activation between the lookup and the loss holds half the tokens
    norms = [n for n in p.nodes if n.kind == "norm"]
    assert norms and all(n.local_shape[1] == 8 for n in norms)


def test_token_fold_keeps_the_dense_values():
    """passes/token_fold.py: GPT-2's Conv1D and the causal-LM loss without their token
    flattens, and LFM2's causal convolution as a sequence convolution, compute the dense
    logits, loss and gradients bit for bit."""
    from autoshard.passes.capture import capture
    from autoshard.passes.token_fold import fold_token_flattens

    model = models.build("gpt2")
    inputs = models.batch("gpt2")
    cap = capture(model, example_inputs=inputs)
    folded = fold_token_flattens(cap)
    assert folded is not cap
    models.assert_same_values(cap, folded, {**inputs, "use_cache": False} if "use_cache" in cap.constants else inputs)
    # LFM2's causal convolution (conv1d padded both ends, then its first S outputs)
    from autoshard.ir.tokens import sequence_conv

    model = models.build("lfm2")
    inputs = models.batch("lfm2")
    cap = capture(model, example_inputs=inputs)
    folded = fold_token_flattens(cap)
    assert sum(n.target is sequence_conv for n in folded.module.graph.nodes) == 1
    assert not any(n.target == torch.ops.aten.conv1d.default for n in folded.module.graph.nodes)
    models.assert_same_values(cap, folded, inputs)


@pytest.mark.slow
def test_a_graph_with_no_sequence_to_cut_is_refused():
    """Mamba's scan is a Python loop over the sequence: export makes the sequence static, no
    value carries a sequence symbol, and cp would only replicate the work: refused by name."""
    import autoshard
    from autoshard.ir.errors import ShardingError

    with pytest.raises(ShardingError, match=r"cp=2: no value of MambaForCausalLM's graph has a sequence dim"):
        autoshard.plan(models.build("mamba"), world_size=2, mode="1d", cp=2, batch_size=2, seq_len=8)


@pytest.mark.slow
def test_zero2_training_with_dp_and_cp_follows_dense():
    """dp2 × cp2 with ZeRO-2 (test_zero's recipe: 20 AdamW steps, 2 accumulated micro-batches,
    clipping active): the dense losses within 1e-4 and gradient norms within 1e-5 (relative);
    each rank holds half the AdamW state."""
    from test_train import STEPS, _dense_reference
    from test_zero import _zero_run

    res = get_pool(4, timeout=900).run(_zero_run, "llama", 2, 2, "1d", STEPS, cp=2)
    ref_losses, ref_norms = _dense_reference("llama")
    for rank, r in enumerate(res):
        for i, (a, b) in enumerate(zip(r["losses"], ref_losses)):
            assert abs(a - b) <= 1e-4, f"rank {rank} step {i + 1}: {a} vs dense {b}"
        for i, (a, b) in enumerate(zip(r["norms"], ref_norms)):
            assert abs(a - b) <= 1e-5 * b, f"rank {rank} step {i + 1}: norm {a} vs dense {b}"
        assert 0.98 <= r["opt_bytes"] / (r["plain_bytes"] / 2) <= 1.02


def _ring_vs_sdpa(rank: int, world: int, mask_batch: int, kv_heads: int) -> list[float]:
    import torch.distributed as dist
    import torch.nn.functional as F

    from autoshard.runtime.parallel_ops import ring_attention

    torch.manual_seed(0)
    B, H, S, D = 2, 4, 8, 16
    q = torch.randn(B, H, S, D, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, S, D, requires_grad=True) for _ in range(2))
    m = torch.randn(mask_batch, H, S, S)
    m[..., 0, :] = float("-inf")                # a row no key may see: 0, as the dense safe softmax gives
    m.requires_grad_()
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.5, enable_gqa=kv_heads != H)
    g = torch.randn_like(dense)
    ref = torch.autograd.grad(dense, [q, k, v, m], g)
    rows = slice(rank * S // world, (rank + 1) * S // world)
    local = [t.detach()[:, :, rows].clone().requires_grad_() for t in (q, k, v, m)]
    out = ring_attention(*local, group=dist.new_group(list(range(world))).group_name, scale=0.5)
    got = torch.autograd.grad(out, local, g[:, :, rows])
    return [(out - dense[:, :, rows]).abs().max().item()] + [
        (a - b[:, :, rows]).abs().max().nan_to_num(1.0).item() for a, b in zip(got, ref)]


def _ring_orders(rank: int, world: int, balanced: bool) -> tuple[int, list[float]]:
    """A causal mask with left padding (rows no key may see), grouped kv heads: the ring in
    either order against sdpa, and the scores this rank computed."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from autoshard.runtime import collectives as C
    from autoshard.runtime.parallel_ops import ring_attention, ring_work

    torch.manual_seed(0)
    B, H, S, D = 2, 4, 16, 8
    q = torch.randn(B, H, S, D, requires_grad=True)
    k, v = (torch.randn(B, 2, S, D, requires_grad=True) for _ in range(2))
    m = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S).clone()
    m[0, ..., :3] = False
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    g = torch.randn_like(dense)
    ref = torch.autograd.grad(dense, [q, k, v], g)
    group = dist.new_group(list(range(world))).group_name
    if balanced:
        C.mark_balanced(group)
    cut = lambda t: C.scatter_to(t.detach(), 2, group)          # noqa: E731  the group's own order
    local = [cut(t).requires_grad_() for t in (q, k, v)]
    with ring_work() as box:
        out = ring_attention(*local, cut(m), group=group)
    got = torch.autograd.grad(out, local, cut(g))
    return box["scores"], [(out - cut(dense)).abs().max().item()] + [(a - cut(b)).abs().max().item()
                                                                     for a, b in zip(got, ref)]


def test_ring_attention_balanced_order_skips_hidden_blocks_evenly():
    """4 ranks, causal: both orders equal sdpa; the blocks the mask hides are skipped, and
    only the balanced order (rank r: chunks r and 7-r of 8) leaves every rank the same work."""
    for balanced in (True, False):
        res = get_pool(4).run(_ring_orders, balanced)
        for rank, (_, errs) in enumerate(res):
            assert max(errs) <= 1e-5, (balanced, rank, errs)
        scores = [s for s, _ in res]
        whole = 2 * 4 * 4 * 16        # each rank's 4 query rows × every key, per batch row and head
        if balanced:
            assert len(set(scores)) == 1 and scores[0] < whole, scores
        else:
            assert scores == sorted(scores) and scores[0] < scores[-1] == whole, scores


@pytest.mark.parametrize("mask_batch,kv_heads", [(1, 4), (2, 2)], ids=["broadcast-mask", "full-mask-gqa"])
def test_ring_attention_kernel_equals_sdpa(mask_batch, kv_heads):
    """The ring kernel against torch's attention on the whole sequence: output and the
    gradients of q, k, v and a float mask (broadcast over the batch or not), with grouped
    kv heads and a fully masked row; each rank holds one block of the sequence."""
    for rank, errs in enumerate(get_pool(2).run(_ring_vs_sdpa, mask_batch, kv_heads)):
        assert max(errs) <= 1e-5, (rank, errs)
