"""The activation-trace pass (passes/trace.py) as a self-check: it runs each rank's
forward on meta with the plan's local shapes, and a node whose real output differs
from the plan's local shape makes the plan a ShardingError naming that node."""

from __future__ import annotations

import pytest
import torch
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
    splits exactly on a 2d mesh: refused before any process runs, node named. The
    propagation refuses it at the ``repeat`` (a fallback would gather the batch, but the
    op takes the local batch size as an argument: docs/design.md, "The batch contract"),
    before the trace's consistency check would."""
    import autoshard

    with pytest.raises(ShardingError) as ei:
        autoshard.plan(_config("debertav2"), world_size=4, mode="2d", batch_size=4, seq_len=8)
    msg = str(ei.value)
    assert "no exact rule" in msg and "aten.repeat.default" in msg and "local batch size" in msg
    assert "node: %" in msg and "module: deberta.encoder" in msg


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


def test_a_reshape_whose_sizes_do_not_fit_is_refused(monkeypatch):
    """Mutation: a reshape rule that forgets its size patches (the heads' literal left
    whole on a head-split input) fails on meta; such a failure is the plan's, not meta's,
    so the trace refuses the plan at the view instead of noting it and going on (Gemma-3's
    pooling head at 2d crashed at run time that way)."""
    import autoshard

    real = generic.RULES[generic.aten.reshape.default]     # GQA's repeat_kv: [b, heads, s, d], no -1
    monkeypatch.setitem(generic.RULES, generic.aten.reshape.default, lambda ctx: real(ctx).replace(patches={}))
    with pytest.raises(ShardingError, match="its sizes do not fit") as ei:
        with tp.memo_capture():
            autoshard.plan(_config("llama"), world_size=2, mode="1d", batch_size=4, seq_len=8)
    assert "is invalid for input of size" in str(ei.value) and "aten.reshape.default" in str(ei.value)


@pytest.mark.parametrize("mode,world", [("1d", 4)])
def test_debertav2_is_exact(mode, world):
    from dist_pool import get_pool

    for r in get_pool(world, timeout=600).run(models.check, "debertav2", mode):
        assert not r["failures"], r["failures"]
        assert r["ledger_calls"] == r["plan_calls"] and r["ledger_bytes"] == r["plan_bytes"]


@pytest.mark.slow
def test_replayed_ops_save_what_running_them_saves(monkeypatch):
    """An ATen op met again with the same operand geometry is replayed from what it did the
    first time (outputs, saved tensors), not run: the plan's saved records are those of
    running every op, on a cp plan (ring attention) and a 2d plan (SUMMA), and the
    replay did answer for most ops (the layers repeat)."""
    from autoshard.io.builder import model_from
    from autoshard.launch.capture_share import capture_for_plan
    from autoshard.passes import trace as trace_mod
    from autoshard.passes.pipeline import plan_captured
    from autoshard.policies import make_policy

    cap = capture_for_plan(model_from(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64)).train())
    calls = {"replayed": 0}
    replay = trace_mod._Trace._replay

    def counted(self, rec, inputs):
        calls["replayed"] += 1
        return replay(self, rec, inputs)

    monkeypatch.setattr(trace_mod._Trace, "_replay", counted)
    for pol in (make_policy("1d", 2, cp=2, cp_attention="ring"), make_policy("2d", 4)):
        plans = []
        for on in (False, True):
            monkeypatch.setattr(trace_mod, "_REPLAY", {})
            monkeypatch.setattr(trace_mod, "_REPLAY_ON", on)
            calls["replayed"] = 0
            plans.append(plan_captured(cap, pol, batch_size=2, seq_len=16))
        assert calls["replayed"] > 20
        ran, replayed = plans
        assert [(n.name, n.saved, n.notes) for n in replayed.nodes] == [(n.name, n.saved, n.notes) for n in ran.nodes]
        assert sum(len(n.saved) for n in ran.nodes) > 0


class _Routers(torch.nn.Module):
    """Two like blocks, each normalising a softmax in place (``w /= w.sum()``, as Mixtral's
    and DeBERTa's layers do): the second block's softmax is replayed from the first's."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        for lin in (self.a, self.b):
            w = lin(x).softmax(-1)
            w /= w.sum(-1, keepdim=True)
            x = x + w
        return x


def test_an_in_place_op_on_a_replayed_output_runs_and_a_second_plan_equals_the_first(monkeypatch):
    """A replayed op's output that requires grad is a non-leaf, as the op's own is: an in-place
    op on it runs on meta as it does after the op. A leaf there failed ("a leaf Variable that
    requires grad is being used in an in-place operation"), noted on the node: the second
    block's in the first plan, both blocks' in a second plan of the same model in the same
    process (the replay table filled by the first): the plan depended on what ran before it."""
    from autoshard.passes import trace as trace_mod
    from autoshard.passes.capture import capture
    from autoshard.passes.pipeline import plan_captured
    from autoshard.policies import make_policy

    cap = capture(_Routers().train(), example_inputs={"x": torch.randn(4, 8, 16)})
    monkeypatch.setattr(trace_mod, "_REPLAY", {})
    plans = [plan_captured(cap, make_policy("1d", 2), batch_size=4, seq_len=8) for _ in range(3)]
    monkeypatch.setattr(trace_mod, "_REPLAY_ON", False)
    ran = plan_captured(cap, make_policy("1d", 2), batch_size=4, seq_len=8)   # every op run: the reference

    def rows(p):
        return [(n.name, n.saved, n.notes) for n in p.nodes]

    assert not [n.name for p in plans for n in p.nodes if any("activation trace" in x for x in n.notes)]
    assert rows(plans[0]) == rows(plans[1]) == rows(plans[2]) == rows(ran)
    assert [n.name for n in ran.nodes if n.op == "div_.Tensor" and n.saved]     # the in-place ops saved


class _Normed(torch.nn.Module):
    """Three like blocks of LayerNorm and Linear on the residual stream: at 2d the last two
    norms run the DistLayerNorm kernel on like operands, whose forward saves one tensor
    more than once for its backward."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16))
                                          for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_replayed_kernel_saves_what_running_it_saves(monkeypatch):
    """A plan kernel (and a re-layout step) met again on operands of the same geometry is
    replayed, not run, as an ATen op is: the second DistLayerNorm does not run, and the plan's
    saved records equal those of running every kernel, a tensor the kernel saves twice
    keeping one key (two fresh tensors would count its bytes twice)."""
    from autoshard.ir import kernels as K
    from autoshard.passes import trace as trace_mod
    from autoshard.passes.capture import capture
    from autoshard.passes.pipeline import plan_captured
    from autoshard.policies import make_policy
    from autoshard.runtime import parallel_ops

    runs = {"n": 0}
    norm = parallel_ops._IMPLEMENTATIONS[K.DistLayerNorm]

    def counted(*args, **kwargs):
        runs["n"] += 1
        return norm(*args, **kwargs)

    monkeypatch.setitem(parallel_ops._IMPLEMENTATIONS, K.DistLayerNorm, counted)
    cap = capture(_Normed().train(), example_inputs={"x": torch.randn(4, 8, 16)})
    plans = {}
    for on in (True, False):
        monkeypatch.setattr(trace_mod, "_REPLAY", {})
        monkeypatch.setattr(trace_mod, "_REPLAY_ON", on)
        runs["n"] = 0
        plans[on] = (plan_captured(cap, make_policy("2d", 4), batch_size=4, seq_len=8), runs["n"])
    (replayed, ran_once), (ran, ran_each) = plans[True], plans[False]
    assert ran_each == 2 and ran_once == 1
    assert [(n.name, n.saved, n.notes) for n in replayed.nodes] == [(n.name, n.saved, n.notes) for n in ran.nodes]
    keys = [s.key for n in ran.nodes if isinstance(n.kernel, K.DistLayerNorm) for s in n.saved]
    assert len(set(keys)) < len(keys)           # saved more than once, counted once
