"""Every weight held whole says why (a plan note naming the ATen op or the size that
stopped the split), and ``shard()`` / ``autoshard check`` warn when whole weights keep
the parameter bytes per rank above the mode's ideal (docs/design.md, the plan table's
notes). Planned offline on 2 ranks of 1d: no processes."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import autoshard
from autoshard.launch import pipeline
from autoshard.cli import main
from autoshard.ir.errors import AutoshardWarning
from autoshard.ir.plan import WHOLE_LIMIT

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)


def _plan(cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autoshard.plan(cfg, world_size=2, mode="1d")


@pytest.fixture(scope="module")
def olmo2():
    """q/k RMSNorms over the whole projection (not per head): split in 1d, the norm's
    mean square a partial sum all-reduced per token (a distributed RMSNorm)."""
    torch.manual_seed(0)
    return _plan(transformers.Olmo2Config(**TINY, num_key_value_heads=4))


def _bloom_config():
    cfg = transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=128, hidden_dropout=0.0,
                                   attention_dropout=0.0)
    cfg.architectures = ["BloomForCausalLM"]
    return cfg


@pytest.fixture(scope="module")
def bloom():
    """Layers no 1d rule splits: the fused QKV interleaved per head is reshaped with the heads
    merged under the batch for ALiBi's baddbmm (a rank's heads would be one block per sample),
    and the attention output meets the residual's LayerNorm: 1.32x the 1d ideal."""
    return _plan(_bloom_config())


@pytest.fixture(scope="module")
def llama_kv1():
    """One kv head at tp 2 (multi-query attention)."""
    return _plan(transformers.LlamaConfig(**TINY, num_key_value_heads=1))


@pytest.fixture(scope="module")
def llama():
    """kv heads divisible by tp: everything splits."""
    return _plan(transformers.LlamaConfig(**TINY, num_key_value_heads=2))


def _whole(plan):
    return [n for n in plan.nodes if n.kind in ("linear", "embedding") and n.weight == "replicated"]


def _why(n) -> str:
    return next((x for x in n.notes if x.startswith("whole:")), "")


def test_every_whole_weight_says_why(bloom, llama_kv1, llama):
    for plan in (bloom, llama_kv1, llama):
        silent = [n.name for n in _whole(plan) if not _why(n)]
        assert not silent, f"{plan.model}: weights held whole with no note: {silent}"


def test_qk_norm_over_the_whole_projection_is_split(olmo2, llama):
    """OLMo-2's q/k RMSNorms normalise the whole projection (every head at once): the
    column split passes them, the mean square is all-reduced per token, so no Linear
    is whole and the bytes per rank are the ideal's (ranks: tests/test_modality.py)."""
    assert [n.module for n in _whole(olmo2) if n.kind == "linear"] == []
    assert not olmo2.fallbacks
    assert olmo2.parallel_fraction()["vs_ideal"] < 1.05
    def per_token(plan):        # all-reduces of one fp32 value per token (statistics; the loss's own)
        size = plan.batch_size * plan.seq_len * 4
        return [c for c in plan.comms("fwd") if c.kind == "all_reduce" and c.buffer_bytes == size]

    assert (olmo2.batch_size, olmo2.seq_len) == (llama.batch_size, llama.seq_len)
    assert len(per_token(olmo2)) - len(per_token(llama)) == 4     # the q and k norms of 2 layers


def test_per_head_qk_norm_weights_split_with_their_heads():
    """Cohere's per-head q/k LayerNorms hold a ``[heads, head_dim]`` weight cast to float
    before it scales the head-split q/k (``weight.to(float32) * x``): the cast parameter
    takes the heads' split (it was held whole, sliced on every use, 1.23x the ideal on a
    larger model); exact on ranks: test_per_head_qk_norm_equals_dense."""
    plan = _plan(transformers.CohereConfig(**TINY, num_key_value_heads=4, use_qk_norm=True))
    norms = {p.name: p.spec for p in plan.params if "q_norm" in p.name or "k_norm" in p.name}
    assert len(norms) == 4 and all(s.dims[0] == ("tp",) and s.dims[1] == () for s in norms.values()), norms
    assert plan.parallel_fraction()["vs_ideal"] < 1.02 and not plan.fallbacks


@pytest.mark.slow       # 2 ranks, one export (~30 s)
def test_per_head_qk_norm_equals_dense():
    import models
    from dist_pool import get_pool

    for rank, r in enumerate(get_pool(2, timeout=600).run(models.check, "cohere", "1d")):
        assert r["failures"] == [], f"rank {rank}: {r['failures'][:5]}"
        assert (r["ledger_bytes"], r["ledger_calls"]) == (r["plan_bytes"], r["plan_calls"]), f"rank {rank}"


def test_single_kv_head_is_held_as_copies(llama_kv1):
    """The one kv head is held by the ranks whose query heads read it (a copy each, its
    gradient summed over them: docs/design.md, kv copies), not left whole with a note."""
    assert not [n for n in _whole(llama_kv1) if n.module.endswith(("k_proj", "v_proj"))]
    kv = [p for p in llama_kv1.params if p.name.endswith(("k_proj.weight", "v_proj.weight"))]
    assert len(kv) == 4 and all(p.pad_copies == 2 and p.dense_shape[0] == 16 for p in kv), kv


def test_warning_names_the_largest_whole_weights(bloom):
    f = bloom.parallel_fraction()
    assert f["vs_ideal"] > WHOLE_LIMIT
    report = bloom.whole_report()
    assert f"{f['vs_ideal']:.2f}× the 1d ideal" in report
    assert "self_attention.query_key_value.weight" in report and "`aten.reshape.default`" in report
    assert "merges the split dim 1 under dim 0" in report
    with pytest.warns(AutoshardWarning, match=r"held whole: transformer\.h\.\d\.self_attention\.query_key_value\.weight"):
        pipeline._warn_whole(bloom)


def test_fully_split_model_does_not_warn(llama):
    assert not _whole(llama)
    assert llama.parallel_fraction()["vs_ideal"] <= WHOLE_LIMIT and llama.whole_report() == ""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipeline._warn_whole(llama)


def test_check_shows_the_warning(tmp_path, capsys):
    path = tmp_path / "config.json"
    _bloom_config().to_json_file(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main(["check", str(path), "-w", "2", "-m", "1d"])
    out = capsys.readouterr().out
    assert "warning: parameter bytes per rank are" in out and "query_key_value.weight" in out
    assert "could not pass `aten.reshape.default` (reshape (s43, 4, s38, 16)->(4*s43, s38, 16)" in out   # grouped
