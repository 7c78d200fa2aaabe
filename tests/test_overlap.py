"""Bucketed gradient all-reduces overlapped with backward (``overlap_grad_sync``,
issue 22): every local gradient equal to the per-parameter path's (itself equal to
dense: test_equivalence), gradient accumulation included; the ledger counts one call
per bucket and the same bytes as the plan's per-parameter list."""

from __future__ import annotations

import copy

import pytest
import torch

import models
from dist_pool import get_pool


def _compare(rank, world, mode, dp, bucket_bytes):
    import autoshard
    from autoshard.runtime.collectives import CommLedger

    torch.set_num_threads(1)
    dense = models.build("llama")
    tp = world // dp
    full = models.batch("llama", b=4 * dp)
    rows = slice((rank // tp) * 4, (rank // tp + 1) * 4)
    inputs = {k: v[rows] for k, v in full.items()}
    plain = autoshard.shard(copy.deepcopy(dense), mode=mode, dp=dp, example_inputs=inputs)
    plain.set_grad_sync()          # one blocking all-reduce per parameter
    over = autoshard.shard(copy.deepcopy(dense), mode=mode, dp=dp, example_inputs=inputs)
    over.overlap_grad_sync(bucket_bytes=bucket_bytes)
    half = {k: v[:2] for k, v in inputs.items()}
    rest = {k: v[2:] for k, v in inputs.items()}
    ledgers = {}
    for name, m in (("plain", plain), ("overlap", over)):
        with CommLedger() as led:
            m(**half).loss.backward()           # two micro-batches: .grad accumulates
            m(**rest).loss.backward()
        ledgers[name] = led
    sync = plain.plan.grad_sync_comms()
    diffs = {}
    op = dict(over.named_parameters())
    for n, p in plain.named_parameters():
        q = op[n]
        diffs[n] = None if p.grad is None and q.grad is None else (p.grad - q.grad).abs().max().item()
    by = {k: v for k, v in ledgers["overlap"].by_kind().items()}
    return {"diffs": diffs, "plain_calls": ledgers["plain"].count(), "over_calls": ledgers["overlap"].count(),
            "plain_bytes": ledgers["plain"].bytes_per_rank(), "over_bytes": ledgers["overlap"].bytes_per_rank(),
            "sync_calls": len(sync), "sync_groups": len({c.axes for c in sync}), "by_kind": str(by)}


@pytest.mark.parametrize("case", [("1d", 4, 2, 1 << 30), ("2d", 4, 1, 4096)], ids=["1d-tp2-dp2-one-bucket", "2d-small-buckets"])
def test_overlapped_grad_sync_equals_per_parameter(case):
    mode, world, dp, bucket = case
    for rank, r in enumerate(get_pool(world, timeout=600).run(_compare, mode, dp, bucket)):
        bad = {n: d for n, d in r["diffs"].items() if d is None or d > 0}
        assert not bad, f"rank {rank}: grads differ from the per-parameter sync: {bad}"
        assert r["over_bytes"] == pytest.approx(r["plain_bytes"]), r
        assert r["sync_calls"] > r["sync_groups"]
        if bucket >= 1 << 30:       # one bucket per group and backward: far fewer calls
            assert r["plain_calls"] - r["over_calls"] == 2 * (r["sync_calls"] - r["sync_groups"]), r
        else:
            assert r["over_calls"] < r["plain_calls"], r


def _toggled(rank, world, mode, what):
    """Loss, local gradients and ledger of one step with ``what`` ("paired": the paired
    collectives, "prefetch": the weight prefetch) off and on; and how many weight gathers
    the prefetch moves."""
    import autoshard
    from autoshard.runtime.collectives import CommLedger
    from autoshard.runtime.parallel_ops import paired_collectives
    from autoshard.passes.prefetch import prefetch_weights

    torch.set_num_threads(1)
    dense = models.build("llama")
    inputs = models.batch("llama", b=4)
    out = {}
    for on in (False, True):
        m = autoshard.shard(copy.deepcopy(dense), mode=mode, example_inputs=inputs)
        if what == "prefetch":
            m.prefetch_weights(on)
            m(**inputs)                                 # the first call runs node by node (self-check)
        with CommLedger() as led, paired_collectives(on or what != "paired"):
            loss = m(**inputs).loss
            loss.backward()
        out[on] = (loss.detach(), {n: p.grad for n, p in m.named_parameters()}, sorted(led.by_kind().items()),
                   led.count())
    (l0, g0, k0, c0), (l1, g1, k1, c1) = out[False], out[True]
    return {"loss_equal": torch.equal(l0, l1), "ledger_equal": k0 == k1 and c0 == c1, "kinds": str(k1),
            "moved": prefetch_weights(m._graphs[0].gm)[1],
            "grads_differ": [n for n in g0 if not torch.equal(g0[n], g1[n])]}


@pytest.mark.parametrize("case", [("2d", 4), ("3d", 8)], ids=["2d@4", "3d@8"])
def test_paired_collectives_are_exact_and_counted_alike(case):
    """A SUMMA / 3D Linear with its two operand gathers (and gradient scatters) in flight
    together, dX's scatter travelling while dW is computed: bitwise the loss and every
    local gradient of one-after-the-other, the same calls and bytes in the ledger."""
    mode, world = case
    for rank, r in enumerate(get_pool(world, timeout=900).run(_toggled, mode, "paired")):
        assert r["loss_equal"] and not r["grads_differ"], (rank, r)
        assert r["ledger_equal"], (rank, r["kinds"])


@pytest.mark.parametrize("case", [("2d", 4), ("3d", 8)], ids=["2d@4", "3d@8"])
def test_weight_prefetch_is_exact_and_counted_alike(case):
    """Each SUMMA / 3D Linear's weight gather launched one Linear early
    (sharded.prefetch_weights(), passes/prefetch.py): bitwise the loss and every local
    gradient of the plain module, the same calls and bytes in the ledger."""
    mode, world = case
    for rank, r in enumerate(get_pool(world, timeout=900).run(_toggled, mode, "prefetch")):
        assert r["moved"] >= 13, (rank, r)             # 2 layers x 7 Linears (+ the head): all but the first
        assert r["loss_equal"] and not r["grads_differ"], (rank, r)
        assert r["ledger_equal"], (rank, r)


def _async_vs_plain(rank, world, chunks, mode="1d"):
    import autoshard
    from autoshard.passes.async_tp import async_row_linears
    from autoshard.runtime.collectives import CommLedger

    torch.set_num_threads(1)
    dense = models.build("llama")
    inputs = models.batch("llama", b=4)
    out = {}
    for c in (1, chunks):
        m = autoshard.shard(copy.deepcopy(dense), mode=mode, example_inputs=inputs).async_tp(c)
        m(**inputs)                                     # the first call runs node by node (self-check)
        with CommLedger() as led:
            o = m(**inputs)
            o.loss.backward()
        out[c] = (o.loss.detach(), o.logits.detach(), {n: p.grad for n, p in m.named_parameters()},
                  led.count(), led.bytes_per_rank())
    (l0, y0, g0, c0, b0), (l1, y1, g1, c1, b1) = out[1], out[chunks]
    worst = max([(l0 - l1).abs().item(), (y0 - y1).abs().max().item()] +
                [(g0[n] - g1[n]).abs().max().item() for n in g0 if g0[n] is not None])
    return {"worst": worst, "calls": (c0, c1), "bytes": (b0, b1), "changed": async_row_linears(m._graphs[0].gm, 2)[1]}


@pytest.mark.parametrize("mode,chunks", [("1d", 2), ("1d", 3), ("1d-sp", 2)])
def test_async_tp_is_exact_and_counts_its_chunks(mode, chunks):
    """``sharded.async_tp(c)``: each row-parallel Linear's rows in ``c`` blocks, each
    block's all-reduce (1d-sp: reduce-scatter on the sequence, the blocks being chunks of
    the batch) launched while the next multiplies: loss, logits and every local gradient
    within 1e-6 of the plain module (itself equal to dense: test_equivalence); the ledger
    counts ``c`` calls per such Linear and the same bytes."""
    for rank, r in enumerate(get_pool(2, timeout=600).run(_async_vs_plain, chunks, mode)):
        assert r["worst"] <= 1e-6, (rank, r)
        # 2 layers × (o_proj, down_proj); 1d-sp: and the sequence gathers before q/k/v and gate/up
        # of each layer and before the LM head
        assert r["changed"] == (4 if mode == "1d" else 9), r
        assert r["calls"][1] - r["calls"][0] == (chunks - 1) * r["changed"], r
        assert r["bytes"][1] == pytest.approx(r["bytes"][0]), r


def test_async_tp_refuses_a_bad_chunk_count():
    from autoshard.ir.errors import ConfigError
    from autoshard.module import ShardedModule

    with pytest.raises(ConfigError, match=r"async_tp\(chunks=0\): a whole number of row blocks >= 1"):
        ShardedModule.async_tp(object.__new__(ShardedModule), 0)


def _default_calls(rank, world):
    import autoshard
    from autoshard.runtime.collectives import CommLedger

    torch.set_num_threads(1)
    dense = models.build("llama")
    inputs = models.batch("llama", b=4)
    cap = models.shared_capture("llama", dense, inputs)
    counts = {}
    for how in ("default", "overlap", "per-parameter"):
        m = autoshard.shard(copy.deepcopy(dense), mode="1d", dp=2, example_inputs=inputs, captured=cap)
        if how == "overlap":
            m.overlap_grad_sync()
        elif how == "per-parameter":
            m.set_grad_sync()
        with CommLedger() as led:
            m(**inputs).loss.backward()
        counts[how] = led.count()
        if how == "default":
            counts["plan"] = len(m.plan.comms())
    return counts


def test_a_default_training_step_syncs_gradients_in_buckets():
    """The default gradient sync is bucketed: a 1d step (tp2 × dp2) makes no more calls than
    after ``overlap_grad_sync()`` (1 MiB buckets), fewer than one all-reduce per parameter,
    and as many as the plan counts."""
    for rank, c in enumerate(get_pool(4, timeout=600).run(_default_calls)):
        assert c["default"] <= c["overlap"] < c["per-parameter"], (rank, c)
        assert c["default"] == c["plan"], (rank, c)
