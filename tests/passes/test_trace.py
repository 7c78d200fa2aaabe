"""The activation-trace pass (passes/trace.py) as a self-check: it runs each rank's
forward on meta with the plan's local shapes, and a node whose real output differs
from the plan's local shape makes the plan a ShardingError naming that node."""

from __future__ import annotations

import pytest
import transformers

import models
import tiny_plans as tp
from autoshard import ShardingError
from autoshard.policies import generic
from autoshard.ir.spec import ShardSpec


def _config(name: str):
    cls, cfg_cls, kw = models.TINY[name]
    return getattr(transformers, cfg_cls)(**kw, architectures=[cls])


def test_debertav2_2d_is_refused_at_the_node_that_would_compute_the_wrong_block():
    """Its relative-position index is expanded to [heads·batch, s, s], which no rule
    splits exactly on a 2d mesh: refused before any process runs, node named."""
    import autoshard

    with pytest.raises(ShardingError) as ei:
        autoshard.plan(_config("debertav2"), world_size=4, mode="2d", batch_size=4, seq_len=8)
    msg = str(ei.value)
    assert "the plan is inconsistent at this node" in msg and "node: %" in msg and "module: deberta.encoder" in msg


def test_a_broken_rule_is_caught(monkeypatch):
    """Mutation: an unsqueeze rule that claims its output keeps the input split one dim
    too far left plans without complaint in propagation; the trace refuses it."""
    import autoshard

    real = generic.RULES[generic.aten.unsqueeze.default]

    def broken(ctx):
        c = real(ctx)
        out = c.out
        if isinstance(out, ShardSpec) and any(out.dims) and not out.dims[0]:
            dims = list(out.dims)
            j = next(i for i, d in enumerate(dims) if d)
            dims[j - 1], dims[j] = dims[j], ()
            c = c.replace(out=ShardSpec(dims=tuple(dims)))
        return c

    assert autoshard.plan(_config("llama"), world_size=2, mode="1d", batch_size=4, seq_len=8)   # sound as it is
    monkeypatch.setitem(generic.RULES, generic.aten.unsqueeze.default, broken)
    with pytest.raises(ShardingError, match="the plan is inconsistent at this node"):
        with tp.memo_capture():
            autoshard.plan(_config("llama"), world_size=2, mode="1d", batch_size=4, seq_len=8)


@pytest.mark.parametrize("mode,world", [("1d", 4)])
def test_debertav2_is_exact(mode, world):
    from dist_pool import get_pool

    for r in get_pool(world, timeout=600).run(models.check, "debertav2", mode):
        assert not r["failures"], r["failures"]
        assert r["ledger_calls"] == r["plan_calls"] and r["ledger_bytes"] == r["plan_bytes"]
