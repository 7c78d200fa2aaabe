"""The search prices candidates on a stamped capture's shallow graphs (docs/design.md,
"Pricing the search"): the same ranked table and choice as planning every candidate on
the full graph, the chosen candidate planned whole; and ring attention on meta is not
walked block by block, its saved tensors unchanged."""

from __future__ import annotations

import dataclasses
import math

import pytest
import transformers

from autoshard.io.builder import model_from
from autoshard.launch.capture_share import capture_for_plan
from autoshard.planning.search import search

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64)


def _close(a, b, path="") -> list[str]:
    """Where two ``SearchResult.to_dict()`` differ (floats to 1e-9 relative)."""
    if isinstance(a, dict):
        return [d for k in a for d in _close(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and path.endswith("notes"):
        return [] if sorted(a) == sorted(b) else [path]
    if isinstance(a, list):
        return [f"{path}: {len(a)} vs {len(b)}"] if len(a) != len(b) else \
            [d for i, (x, y) in enumerate(zip(a, b)) for d in _close(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, (int, float)):
        return [] if math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9) else [f"{path}: {a} vs {b}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


@pytest.fixture(scope="module")
def llama6():
    """Tiny Llama, 6 layers: 3 exported, 3 stamped (one export for the module's tests)."""
    return capture_for_plan(model_from(transformers.LlamaConfig(**LLAMA)).train())


def _same_search(cfg_or_cap, **kw):
    cap = cfg_or_cap if not isinstance(cfg_or_cap, transformers.PretrainedConfig) else \
        capture_for_plan(model_from(cfg_or_cap).train())
    assert cap.stamped and cap.shallow is not None
    priced = search(cap, **kw)
    whole = search(dataclasses.replace(cap, shallow=None), **kw)          # every candidate planned whole
    assert _close(priced.to_dict(), whole.to_dict()) == []
    assert [e.fallbacks for e in priced.results] == [len(e.plan.fallbacks) if e.plan else 0 for e in whole.results]
    assert priced.best.plan is not None and priced.best.plan.nodes == whole.best.plan.nodes
    assert all(e.plan is None for e in priced.results[1:] if e.cost is not None)    # priced, not planned
    return priced


def test_priced_search_equals_planning_every_candidate_whole(llama6):
    """2 ranks with cp searched: every figure of every candidate, and the choice, as if
    each were planned on the full graph."""
    res = _same_search(llama6, world_size=2, cp=None, batch_size=2, seq_len=32)
    assert any(e.candidate.cp > 1 and e.ok for e in res.results)


@pytest.mark.slow
def test_priced_search_equals_whole_for_two_stacks_and_gathered_kv(llama6):
    """BART (an encoder and a decoder stack, each grown from its own rung) and Llama at
    4 ranks with ``cp_attention="auto"``."""
    bart = transformers.BartConfig(d_model=32, encoder_layers=5, decoder_layers=6, encoder_attention_heads=4,
                                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64)
    _same_search(bart, world_size=4, cp=None, batch_size=4, seq_len=32)
    _same_search(llama6, world_size=4, cp=None, batch_size=2, seq_len=64, cp_attention="auto")


def test_ring_attention_on_meta_walks_no_block(llama6):
    """The activation trace of a cp plan computes no score block (it walked ``p·R²`` per
    layer before), and records what the ring saves: q, k, v, its output and log-sum-exp."""
    from autoshard.passes.pipeline import plan_captured
    from autoshard.policies import make_policy
    from autoshard.runtime.parallel_ops import ring_work

    with ring_work() as box:
        plan = plan_captured(llama6.shallow.base, make_policy("1d", 4, cp=4, cp_attention="ring"), batch_size=2,
                             seq_len=32)
    assert box["scores"] == 0
    ring = [n for n in plan.nodes if n.kernel is not None and "ring" in type(n.kernel).__name__.lower()]
    assert ring, [type(n.kernel).__name__ for n in plan.nodes if n.kernel is not None]
    saved = [s.shape for s in ring[0].saved]
    q = saved[0]
    assert q[:-1] + (1,) in saved and saved.count(q) >= 2      # out beside q; the log-sum-exp


@pytest.mark.slow
def test_a_split_that_pads_the_heads_twice_over_is_not_priced_while_another_fits(llama6):
    """4 query heads (2 kv heads) on 1d [8]: each kv head copied to 4 ranks, its 2 query heads
    padded to 4 (docs/design.md, "Pricing the search"). Beside narrower splits that fit it
    is left out unpriced, named; alone (dp pinned to 1) it is priced and chosen."""
    res = search(llama6, world_size=8, modes=("1d",), batch_size=8, seq_len=32)
    wide = [e for e in res.results if e.candidate.label == "1d [8]"]
    assert len(wide) == 1 and wide[0].cost is None and not wide[0].ok
    assert wide[0].reason == "pads 4 heads to 8: at least half of them zeros, not priced"
    assert all(e.candidate.q < 8 for e in res.ranked) and res.ranked
    alone = search(llama6, world_size=8, modes=("1d",), dp=1, batch_size=8, seq_len=32)
    assert alone.best.candidate.label == "1d [8]" and alone.best.cost is not None


def test_priced_search_counts_the_full_graphs_gradient_buckets(llama6, monkeypatch):
    """Gradient buckets that span layers (30 kB here, a layer holding 19 kB): their count is not linear in the
    layers, so the parameters' figures are taken from the full graph's parameter list,
    not extrapolated; every figure as if each candidate were planned whole."""
    from autoshard.ir.plan import ShardingPlan

    buckets = ShardingPlan.grad_sync_buckets
    monkeypatch.setattr(ShardingPlan, "grad_sync_buckets", lambda self, bucket_bytes=30000: buckets(self, bucket_bytes))
    res = _same_search(llama6, world_size=4, batch_size=4, seq_len=16, modes=("1d",))
    assert any(e.cost.collective_calls > 0 for e in res.ranked)
