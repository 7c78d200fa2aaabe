"""The live profiler (autoshard/planning/profile.py): its fits, its public names, and
``autoshard.profile`` measured on gloo ranks. The cost model it feeds is tested in
tests/test_cost.py."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

import autoshard
from autoshard.ir.errors import ConfigError
from autoshard.planning import cost, profile as prof

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_public_names_resolve_to_their_modules():
    assert autoshard.profile is prof.profile
    assert autoshard.estimate is cost.estimate
    assert autoshard.Cluster is cost.Cluster and autoshard.CLUSTERS is cost.CLUSTERS


def test_cost_model_runs_no_collective():
    """The cost model stays pure: cost.py imports neither torch.distributed nor the runtime."""
    tree = ast.parse((ROOT / "autoshard" / "planning" / "cost.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any("distributed" in m or "runtime" in m or "profile" in m for m in names), names
    assert "profile" not in cost.__all__


def test_fit_alpha_beta_recovers_latency_and_bandwidth():
    alpha, beta = 5e-6, 2e9
    samples = [(s, b, s * alpha + b / beta) for s in (1, 2, 6) for b in (1e3, 1e6, 4e6)]
    a, b = prof._fit_alpha_beta(samples)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def test_fit_call_cost_separates_the_call_from_the_ring_steps():
    """Tiny all-reduces on groups of 2 and 4 (2 and 6 ring steps) give the call cost and α;
    β is read off the largest messages once both are taken off."""
    call, alpha, beta = 1e-3, 2e-4, 1e9
    tiny = [(2, call + 2 * alpha), (6, call + 6 * alpha)]
    samples = [(2, 1e3, 9.0), (2, 8e6, call + 2 * alpha + 8e6 / beta), (1, 8e6, call + alpha + 8e6 / beta)]
    got_call, (a, b) = prof._fit_call_cost(tiny, samples, (0.0, 1.0))
    assert got_call == pytest.approx(call) and a == pytest.approx(alpha) and b == pytest.approx(beta)
    assert prof._fit_call_cost([(2, 5e-3)], samples, (1e-3, 7.0)) == (pytest.approx(3e-3), (1e-3, 7.0))
    assert prof._fit_call_cost([], samples, (1e-3, 7.0)) == (0.0, (1e-3, 7.0))


def test_profile_needs_a_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process already belongs to a process group")
    with pytest.raises(ConfigError, match="initialised process group.*torchrun"):
        autoshard.profile()


def test_profile_cli_needs_torchrun(capsys):
    from autoshard.cli import main

    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        assert main(["profile", "--out", "x.json"]) == 2
    finally:
        os.environ.update(env)
    assert "torchrun --nproc-per-node" in capsys.readouterr().err


# ------------------------------------------------------------------ processes

def _profile_one_rank_per_node(rank, world):
    """Two "nodes" of one rank: the inter-node groups are timed and the intra-node
    figures copy them; a ranks_per_node that does not divide the world is refused first."""
    import autoshard
    from autoshard.ir.errors import ConfigError

    try:
        autoshard.profile(ranks_per_node=3)
        bad = None
    except ConfigError as e:
        bad = str(e)
    c = autoshard.profile(sizes=(1 << 10, 1 << 16), iters=2, ranks_per_node=1, matmul_size=64, memory_bytes=1 << 30)
    return c, bad


def test_profile_across_nodes_on_gloo():
    from dist_pool import get_pool

    (c0, bad), (c1, _) = get_pool(2).run(_profile_one_rank_per_node)
    assert bad is not None and "ranks_per_node=3 must divide the world size 2" in bad
    assert c0 == c1 and c0.ranks_per_node == 1 and c0.device == "cpu"
    assert (c0.intra_latency, c0.intra_bw) == (c0.inter_latency, c0.inter_bw) and c0.inter_bw > 0
    assert c0.call_overhead == 0.0          # a node of one rank: no group to time a call on
    assert c0.pair_overlap == 0.0 and c0.memory_bytes == 1 << 30
    assert [e for e, _ in c0.flops_curve] == [32, 64] and c0.flops == c0.flops_curve[-1][1]


def _profile_and_auto(rank, world):
    import models
    import autoshard

    c = autoshard.profile(sizes=(1 << 10, 1 << 16), iters=2, matmul_size=128)
    res = models.check(rank, world, "llama", "auto", share_capture=True)
    return c, res


@pytest.mark.slow          # 2 spawned ranks each import torch and export the model
def test_profile_and_shard_auto_on_gloo():
    from dist_pool import get_pool

    out = get_pool(2).run(_profile_and_auto)
    (c0, r0), (c1, _) = out
    assert c0 == c1 and c0.name == "measured" and c0.ranks_per_node == 2
    assert c0.intra_bw > 0 and c0.flops > 0 and c0.memory_bytes > 0
    assert c0.op_overhead > 0 and c0.call_overhead >= 0
    assert c0.pair_overlap == 0.0          # 2 ranks: no 2 × 2 block to measure a pair on; a CPU shares its cores
    assert [e for e, _ in c0.flops_curve] == [32, 64, 128] and all(r > 0 for _, r in c0.flops_curve)
    assert r0["failures"] == [], r0["failures"]
    assert r0["ledger_bytes"] == pytest.approx(r0["plan_bytes"])
