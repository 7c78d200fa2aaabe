"""The runtime self-check (``autoshard/runtime/selfcheck.py``): the first call of every
graph compares each node's local output shape with its plan spec.

A mutation test plants a wrong rule (the activation of Llama's MLP claims its
output whole while its input is split over tp, so the rewrite inserts no
gather). Two layers catch it: planning refuses it (the activation trace,
``passes/trace.py``, runs every op on meta with the plan's local shapes), and,
for what that trace cannot run (ops with data-dependent output, sizes read at
run time) and so skips, the first forward stops at the node, naming it, the op,
the spec and both shapes, on every rank alike.
"""

from __future__ import annotations

import copy
import os

import models
from dist_pool import get_pool


def _run(rank, world, mutate: bool, skip_trace: bool = False, self_check: bool = True):
    import torch

    import autoshard
    from autoshard.ir.errors import ShardingError
    from autoshard.passes import pipeline
    from autoshard.policies import generic
    from autoshard.runtime.selfcheck import PlanCheckError
    from autoshard.ir.spec import ShardSpec

    torch.set_num_threads(1)
    silu = torch.ops.aten.silu.default
    orig = generic.RULES[silu]

    def wrong(ctx):          # the planted bug: silu's output claimed whole (no gather inserted)
        ch = orig(ctx)
        if ctx.node.target == torch.ops.aten.silu.default:
            return ch.replace(out=ShardSpec(dims=tuple(() for _ in ch.out.dims)))
        return ch

    orig_trace = pipeline.trace
    generic.RULES[silu] = wrong if mutate else orig
    if skip_trace:           # as for a node the meta trace cannot run
        pipeline.trace = lambda plan, gm: plan
    # a patched rule is no edit of autoshard's source: a launch-cache entry of an earlier
    # test would skip the planning under test
    launch = os.environ.get("AUTOSHARD_LAUNCH_CACHE")
    os.environ["AUTOSHARD_LAUNCH_CACHE"] = "off"
    try:
        model = models.build("llama")
        inputs = models.batch("llama")
        try:
            sharded = autoshard.shard(copy.deepcopy(model), mode="1d", example_inputs=inputs)
        except ShardingError as e:
            return {"refused": str(e)}
        sharded.self_check = self_check
        try:
            out = sharded(**inputs)
            out2 = sharded(**inputs)
        except PlanCheckError as e:
            return {"error": str(e)}
        except Exception as e:          # noqa: BLE001 - what an unchecked wrong plan does
            return {"other": f"{type(e).__name__}: {e}"}
        ref = model(**inputs).loss
        return {"loss_err": abs(out.loss.item() - ref.item()), "again_err": abs(out2.loss.item() - ref.item()),
                "checked": len(sharded._checked)}
    finally:
        generic.RULES[silu], pipeline.trace = orig, orig_trace
        if launch is None:
            os.environ.pop("AUTOSHARD_LAUNCH_CACHE", None)
        else:
            os.environ["AUTOSHARD_LAUNCH_CACHE"] = launch


def test_selfcheck_passes_a_correct_plan():
    """A correct plan runs its first call through the check (and gives the dense loss);
    later calls run the plain graph."""
    for r in get_pool(2, timeout=300).run(_run, False):
        assert r.get("error") is None and r.get("other") is None, r
        assert r["loss_err"] < 1e-5 and r["again_err"] < 1e-5 and r["checked"] == 1, r


def test_selfcheck_catches_a_broken_rule():
    """Mutation: a rule that mis-states a layout is refused at planning by the meta
    trace, and, where that trace cannot run the node, caught at its node on the
    first forward (every rank alike), with the node, op, spec and both shapes."""
    pool = get_pool(2, timeout=300)
    for r in pool.run(_run, True):
        assert "plan is inconsistent" in r.get("refused", "") and "%silu" in r["refused"], r
    res = pool.run(_run, True, True)
    for r in res:
        msg = r.get("error")
        assert msg is not None, r
        assert "planner bug: node silu (silu)" in msg and "(4, 8, 64)" in msg and "(4, 8, 128)" in msg, msg
        assert "[R, R, R]" in msg, msg
    assert res[0]["error"] == res[1]["error"]
    # with both checks off the same broken plan is not stopped at its node
    off = pool.run(_run, True, True, False)
    assert all(r.get("error") is None and r.get("refused") is None for r in off), off
