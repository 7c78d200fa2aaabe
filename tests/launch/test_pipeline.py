"""The launch pipeline (autoshard/launch/pipeline.py) and its config (autoshard/config.py):
stages check what they require and ensure, the config is checked once before any
collective, and ``shard()`` prepares its capture once."""

from __future__ import annotations

import os

import pytest
import torch

import models
from dist_pool import get_pool
from autoshard.config import ShardConfig
from autoshard.ir.errors import ConfigError
from autoshard.launch.pipeline import LAUNCH, PIPELINE, LaunchState, Stage, StageError


def test_the_stages_are_named_in_order():
    assert tuple(PIPELINE.stages) == LAUNCH + ("place",)


def test_a_stage_names_what_it_lacks_and_what_it_left_unset():
    cfg = ShardConfig.of(mode="1d")
    with pytest.raises(StageError, match="stage 'rewrite' requires prepared, plan, groups; missing: prepared, plan"):
        PIPELINE.run(LaunchState(config=cfg, groups={}), "rewrite")
    lazy = Stage("lazy", lambda s: s, requires=("config",), ensures=("plan",))
    with pytest.raises(StageError, match="stage 'lazy' ensures plan; it left plan unset"):
        lazy(LaunchState(config=cfg))


def test_the_config_folds_and_checks_once():
    assert ShardConfig.of(mode="1d", sequence_parallel=True).mode == "1d-sp"
    for bad, match in ((dict(mode="2d", sequence_parallel=True), "valid choices: mode='1d'"),
                       (dict(mode="1d", dropout="half"), "valid: 'sharded', 'dense'"),
                       (dict(mode="1d", ep=2, pp=2), "choose ep=1 with pp>1"),
                       (dict(mode="2d", ep=2, dp=2), "composes with mode='1d' only"),
                       (dict(mode="1d", fsdp=True), "it needs dp >= 2")):
        with pytest.raises(ConfigError, match=match):
            ShardConfig.of(**bad)
    with pytest.raises(Exception):      # frozen
        ShardConfig.of(mode="1d").mode = "2d"


def test_one_place_decides_the_default_cluster():
    from autoshard.planning.cost import default_cluster

    assert ShardConfig.of(entry="plan").search_cluster() == "dgx-a100"
    assert ShardConfig.of(entry="plan", cluster="h100-sxm").search_cluster() == "h100-sxm"
    assert ShardConfig.of().search_cluster() == default_cluster()


def test_resolved_is_the_concrete_layout():
    from autoshard.policies import make_policy

    cfg = ShardConfig.of(mode="auto", cp=2, cp_attention="auto").resolved(make_policy("2.5d", 16, 2, 1, 2, "gather"))
    assert (cfg.mode, cfg.depth, cfg.dp, cfg.cp, cfg.cp_attention) == ("2.5d", 2, 1, 2, "gather")


def _count_prepares(rank: int, world: int) -> int:
    import autoshard
    import autoshard.launch.pipeline as lp
    import autoshard.passes.pipeline as pp

    calls = []
    real = pp.prepare

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    lp.prepare = pp.prepare = counted       # the stage's call and any call inside the planner
    os.environ["AUTOSHARD_LAUNCH_CACHE"] = "off"        # the whole way, not a relaunch
    try:
        sm = autoshard.shard(models.build("llama"), mode="1d", example_inputs=models.batch("llama"))
    finally:
        lp.prepare = pp.prepare = real
        os.environ.pop("AUTOSHARD_LAUNCH_CACHE", None)
    assert sm.plan.mode == "1d"
    return len(calls)


def test_shard_prepares_its_capture_once():
    assert get_pool(2).run(_count_prepares) == [1, 1]
