"""A new mode is one policy module: the proof.

``VocabOnly`` below is a whole mode in one class, written against the public
policy contract only (:class:`~autoshard.policies.base.Policy`, the
``RuleContext`` a rule receives, the kernel objects of :mod:`autoshard.ir.kernels`):
embedding tables and a tied LM head are vocab-parallel, every other Linear stays
whole. Registered, it is planned, validated, listed by the auto search, and
shards a model exactly on 2 gloo ranks with ledger = plan, without a line
changed under ``passes/`` or in the face.
"""

from __future__ import annotations

import contextlib

import pytest
import transformers

import models
from autoshard.ir.argpath import get_arg
from autoshard.ir.errors import ConfigError
from autoshard.ir.kernels import VocabEmbedding
from autoshard.ir.mesh import Mesh
from autoshard.policies import POLICIES, register_policy
from autoshard.policies.base import Choice, Policy, RuleContext
from autoshard.policies.linear_ops import linear_operands
from autoshard.ir.spec import ShardSpec
from dist_pool import get_pool


class VocabOnly(Policy):
    """Split only the vocabulary: the largest embedding table by rows, and a Linear
    that reuses it (a tied head) by output features; the loss is then vocab-parallel."""

    name = "vocab"
    order = 50
    tp_axes = ("tp",)
    size_unit = "tp sizes"

    @classmethod
    def make_mesh(cls, world_size: int, *, depth: int | None = None, dp: int = 1) -> Mesh:
        if depth not in (None, 1):
            raise ConfigError(f"vocab takes no depth (got depth={depth})")
        tp = cls._check_dp(world_size, dp)
        return Mesh(axes=("dp", "tp"), sizes=(dp, tp)) if dp > 1 else Mesh(axes=("tp",), sizes=(tp,))

    def dim_splits(self):
        p = self.mesh.size("tp")
        return {"vocab_size": p}, f"tp={p}"

    @classmethod
    def valid_world_sizes(cls, n: int, limit: int = 4096) -> list[int]:
        return [p for p in range(1, min(n, limit) + 1) if n % p == 0]

    def linear(self, ctx: RuleContext) -> Choice:
        xp, wp, bp, nd, _ = linear_operands(ctx.node)
        sx = ctx.spec(get_arg(ctx.node, xp))
        rows, rseg = sx.dims[:-1], sx.segments[:-1]
        fixed = ctx.fixed_param_spec(get_arg(ctx.node, wp))
        whole = ShardSpec(dims=rows + ((),), segments=rseg + (1,))
        if fixed is not None and fixed.dims[nd] == self.tp_axes:          # the tied head
            ins = {xp: whole, wp: fixed}
            if bp:
                ins[bp] = ShardSpec(dims=(self.tp_axes,))
            return Choice(out=ShardSpec(dims=rows + (self.tp_axes,), segments=rseg + (1,)), inputs=ins,
                          weight="vocab / tp (tied)")
        ins = {xp: whole, wp: ShardSpec(dims=((), ()))}
        if bp:
            ins[bp] = ShardSpec(dims=((),))
        return Choice(out=whole, inputs=ins, weight="replicated")

    def embedding(self, ctx: RuleContext) -> Choice:
        w, ids = ctx.node.args[0], ctx.node.args[1]
        si = ctx.spec(ids)
        V = ctx.pshape(w)[0]
        tp, c = self.tp_axes, self.mesh.size(self.tp_axes)
        out = ShardSpec(dims=si.dims + ((),))
        if c > 1 and V % c == 0 and ctx.is_largest_embedding(w):
            k = VocabEmbedding(axes=tp, in_specs=(((0,), ShardSpec(dims=(tp, ()))), ((1,), si)), out_spec=out)
            return Choice.run(k, weight=f"vocab / {c}")
        return Choice(out=out, inputs={(0,): ShardSpec(dims=((), ())), (1,): si}, weight="replicated")


@contextlib.contextmanager
def registered():
    register_policy(VocabOnly)
    try:
        yield
    finally:
        POLICIES.pop(VocabOnly.name, None)


def _gpt2_config(**kw):
    return transformers.GPT2Config(**{**models.TINY["gpt2"][2], **kw}, architectures=["GPT2LMHeadModel"])


def test_registered_mode_plans_with_vocab_parallel_table_and_head():
    import autoshard

    with registered():
        p = autoshard.plan(_gpt2_config(), world_size=2, mode="vocab", batch_size=4, seq_len=8)
    assert p.mode == "vocab" and p.mesh.axes == ("tp",)
    wte = next(q for q in p.params if "transformer.wte.weight" in (q.name, *q.aliases))
    assert wte.spec == ShardSpec(dims=(("tp",), ())) and "lm_head.weight" in (wte.name, *wte.aliases)
    kinds = {n.kernel.name for n in p.nodes if n.kernel is not None}
    assert {"vocab_embedding", "cross_entropy"} <= kinds
    ce = next(n for n in p.nodes if n.kernel is not None and n.kernel.name == "cross_entropy")
    assert ce.kernel.vocab_axes == ("tp",)          # the generic loss rule went vocab-parallel by itself
    assert "vocab" not in POLICIES                  # unregistered again


def test_registered_mode_is_validated_and_searched():
    import autoshard
    from autoshard.planning.search import candidates
    from autoshard.planning.validate import check_dims

    with registered():
        # the mode's dim_splits drive validation and the vocabulary padding: 127 is padded to 128
        assert check_dims(_gpt2_config(vocab_size=127), "vocab", Mesh(axes=("tp",), sizes=(2,))) == []
        pads = autoshard.plan(_gpt2_config(vocab_size=127), world_size=2, mode="vocab", batch_size=2,
                              seq_len=8).padding()
        assert [p["padded_shape"][0] for p in pads] == [128]
        assert "vocab [2]" in [c.label for c in candidates(2)]
        with pytest.raises(ConfigError, match="vocab takes no depth"):
            autoshard.plan(_gpt2_config(), world_size=2, mode="vocab", depth=2)


def _check_vocab_mode(rank, world):
    with registered():
        return models.check(rank, world, "gpt2", "vocab")


def test_registered_mode_shards_exactly_and_ledger_equals_plan():
    results = get_pool(2, timeout=600).run(_check_vocab_mode)
    for r in results:
        assert not r["failures"], r["failures"]
        assert r["ledger_calls"] == r["plan_calls"] and r["ledger_bytes"] == r["plan_bytes"]
        assert r["param_bytes"] == r["plan_param_bytes"]
