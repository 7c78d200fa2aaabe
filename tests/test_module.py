"""ShardedModule behaves like the model: config / device / dtype /
generation_config, a readable repr, and load_state_dict of a full (dense) state
dict sliced through the plan, or of the local one."""

from __future__ import annotations

import pytest
import torch

import models
from dist_pool import get_pool


def _load_dense(rank, world, name, mode):
    """Shard a model with other weights (seed 1), check its logits differ from the
    dense model's (seed 0), then load the dense state dict and compare again."""
    import autoshard
    from autoshard.runtime.collectives import CommLedger

    torch.set_num_threads(1)
    dense = models.build(name, seed=0).eval()
    other = models.build(name, seed=1).eval()
    inputs = models.batch(name)
    inputs.pop("labels")
    with torch.no_grad():
        ref = dense(**inputs).logits
    sharded = autoshard.shard(other, mode=mode, example_inputs=inputs)
    with torch.no_grad():
        before = (sharded(**inputs).logits - ref).abs().max().item()
    res = sharded.load_state_dict(dense.state_dict())
    with torch.no_grad():
        after = (sharded(**inputs).logits - ref).abs().max().item()
    local = {k: v.clone() for k, v in sharded.state_dict().items()}
    sharded.load_state_dict(local)                 # the local one loads as it is
    same = all(torch.equal(local[k], v) for k, v in sharded.state_dict().items())
    with CommLedger() as led:
        pass
    return {"before": before, "after": after, "missing": list(res.missing_keys),
            "unexpected": list(res.unexpected_keys), "same": same,
            "config": type(sharded.config).__name__, "device": str(sharded.device), "dtype": str(sharded.dtype),
            "gen": type(sharded.generation_config).__name__, "repr": repr(sharded), "plan_repr": repr(sharded.plan),
            "ledger_repr": repr(led)}


@pytest.mark.parametrize("name,world,mode", [("llama", 2, "1d"), ("gpt2", 2, "1d"), ("llama", 4, "2d"),
                                             ("gpt2", 4, "2d")],
                         ids=["llama-1d-p2", "gpt2-1d-p2", "llama-2d-q2", "gpt2-2d-q2"])
def test_load_full_state_dict_equals_dense(name, world, mode):
    for rank, r in enumerate(get_pool(world, timeout=600).run(_load_dense, name, mode)):
        assert r["before"] > 1e-2, f"rank {rank}: the other seed must give other logits"
        assert r["after"] <= 1e-5, f"rank {rank}: {r['after']}"
        assert r["missing"] == [] and r["unexpected"] == [], r
        assert r["same"]
        assert r["config"].endswith("Config") and r["device"] == "cpu" and r["dtype"] == "torch.float32"
        assert r["gen"] == "GenerationConfig"
        assert r["repr"].startswith("ShardedModule(") and f"mode={mode}" in r["repr"] and f"rank={rank}" in r["repr"]
        assert len(r["repr"]) < 200 and "\n" not in r["repr"]
        assert r["plan_repr"].startswith("ShardingPlan(model=") and "param_bytes_per_rank=" in r["plan_repr"]
        assert r["ledger_repr"] == "CommLedger(0 calls, 0 B/rank)"


def test_ledger_repr_counts_by_kind():
    from autoshard.runtime.collectives import CallRecord, CommLedger

    led = CommLedger()
    led.calls += [CallRecord("all_reduce", "tp", 2, 1000), CallRecord("all_reduce", "tp", 2, 1000)]
    assert repr(led) == "CommLedger(2 calls, 2,000 B/rank: all_reduce(tp) ×2 2,000 B)"
