"""Every rule checked against torch's own samples (tests/opinfo_rules.py), as DTensor
tests its sharding strategies: each ATen op with a rule, traced from the samples of
torch's OpInfo database (and hand-written samples for ops without one), planned by
its rule for each input layout (batch rows split, sequence, last dim, partial sums)
and run on 2 gloo ranks against the op on whole tensors.

`make test` runs a sample (the ops where samples meet: batch norm, cross-entropy,
reductions over the batch, per-sample pooling; a few seconds); `make test-extended`
every OpInfo that reaches a ruled op. The harness is shown to fail on the fallback
that kept the batch split (test_catches_a_fallback_that_keeps_the_batch)."""

from __future__ import annotations

import pytest

import opinfo_rules
from dist_pool import get_pool

SAMPLE_OPINFOS = ("nn.functional.batch_norm", "amax")
SAMPLE_HAND = ("batch_norm_train", "cross_entropy_spatial", "cross_entropy_none", "var_over_batch", "max_pool2d")


def _run(names, hand, limit=2, patch=False):
    return get_pool(2, timeout=1800).run(opinfo_rules.check, names, hand, limit, tuple(opinfo_rules.LAYOUTS), patch)


def test_rules_match_the_whole_op_on_a_sample():
    res = _run(SAMPLE_OPINFOS, SAMPLE_HAND)
    for rank, r in enumerate(res):
        assert r["mismatches"] == [], f"rank {rank}: " + "\n".join(r["mismatches"][:8])
    cov = res[0]["covered"]
    assert "batch" in cov["aten.batch_norm.default"] and "batch" in cov["aten.cross_entropy_loss.default"], cov
    assert set(cov) >= {"aten.batch_norm.default", "aten.amax.default", "aten.cross_entropy_loss.default",
                        "aten.var.dim", "aten.max_pool2d.default"}, cov


def test_catches_a_fallback_that_keeps_the_batch():
    """With the fallback that kept the batch rows split (and no batch_norm rule), the
    harness reports train-mode batch_norm and a variance over the batch as wrong."""
    r = _run((), ("batch_norm_train", "var_over_batch"), patch=True)[0]
    wrong = " ".join(r["mismatches"])
    assert "aten.batch_norm.default [batch]" in wrong and "aten.var.dim [batch]" in wrong, r["mismatches"]


@pytest.mark.extended
def test_rules_match_the_whole_op_on_every_opinfo():
    res = _run(None, None, limit=6)
    r = res[0]
    print(f"OpInfo: {len(r['covered'])} ATen ops, {sum(len(v) for v in r['covered'].values())} op-layouts, "
          f"{r['refused']} layouts refused, {len(r['errors'])} samples not traceable")
    for rank, x in enumerate(res):
        assert x["mismatches"] == [], f"rank {rank}: " + "\n".join(x["mismatches"][:20])
