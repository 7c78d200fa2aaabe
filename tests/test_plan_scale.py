"""Scale acceptance: planning a 7B-shaped Llama takes seconds and no weight memory.

Each plan runs in its own interpreter (the venv's python) so the peak-RSS figure
is clean: the child reports its time, its peak RSS before and after planning,
and writes the plan as JSON for the assertions here.

Time is printed, not asserted (the brief: speed goals live in benchmarks, and
a CPU time measured beside `make test`'s other workers varies with them):
`benchmarks/bench_planning.py` measures planning time. Only a hang-sized bound
fails here; memory (peak RSS) and the plans themselves are asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from autoshard import ShardingPlan

TIME_BUDGET_S = 30.0
RSS_BUDGET_B = 2 * 1024 ** 3

LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000, architectures=["LlamaForCausalLM"])

_CHILD = textwrap.dedent("""
    import io, json, os, resource, sys, time
    import transformers, autoshard
    from rich.console import Console

    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    kw, out = json.loads(sys.argv[1]), sys.argv[2]
    cfg = transformers.LlamaConfig(**kw.pop("config"))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), cpu()
    plan = autoshard.plan(cfg, **kw)
    t1, c1 = time.perf_counter(), cpu()
    buf = io.StringIO()
    plan.show(Console(file=buf, width=220), all_layers=True)      # every row: the budget of the longest table
    t2, c2 = time.perf_counter(), cpu()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    load = max(load, os.getloadavg()[0])
    with open(out, "w") as f:
        f.write(plan.to_json())
    print(json.dumps({"plan_s": t1 - t0, "show_s": t2 - t1, "plan_cpu_s": c1 - c0, "show_cpu_s": c2 - c1,
                      "load": load, "cpus": os.cpu_count(), "rss_before": rss0, "rss_after": rss1,
                      "shown_chars": len(buf.getvalue()), "shown_head": buf.getvalue()[:300]}))
""")


def _start(tmp_path_factory, **kw):
    out = tmp_path_factory.mktemp("scale") / "plan.json"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps({"config": LLAMA_7B, **kw}), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, out


def _finish(proc, out) -> tuple[dict, ShardingPlan]:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    stats = json.loads(stdout.strip().splitlines()[-1])
    return stats, ShardingPlan.from_json(out.read_text())


# a 7B plan per fixture child (102 s of setup in a loaded `make test`): make test-extended
pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both plans, each in its own child, one after the other: the second child
    finds the 7B graph in the session's capture cache (AUTOSHARD_CACHE, inherited)
    instead of exporting it again, as a second launch would. Each child measures its
    own time; wall time is only checked while the load stays within the core count."""
    out = {}
    for key, kw in (("1d", dict(world_size=8, mode="1d")),
                    ("2.5d", dict(world_size=64, mode="2.5d", depth=4, batch_size=16))):
        proc, path = _start(tmp_path_factory, **kw)
        try:
            out[key] = _finish(proc, path)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return out


@pytest.fixture(scope="module")
def run_1d(runs):
    return runs["1d"]


@pytest.fixture(scope="module")
def run_25d(runs):
    return runs["2.5d"]


def _total_bytes(plan):
    return sum(math.prod(p.global_shape) * p.dtype_bytes for p in plan.params if not p.is_buffer)


def _sliced_bytes(plan, rank):
    """Per-rank parameter bytes by slicing meta tensors of the global shapes."""
    return sum(math.prod(p.spec.local(torch.empty(p.global_shape, device="meta"), plan.mesh, rank).shape)
               * 4 for p in plan.params if not p.is_buffer)


def _check_time(stats, keys):
    """Reported, not asserted: a time measured beside the suite's other workers is
    the neighbours' as much as the planner's (it read 24 s CPU idle and 32 s under
    a full `make test`). The planning-time goal lives in benchmarks/bench_planning.py;
    here only a hang-sized bound (10× the goal) fails."""
    wall = sum(stats[f"{k}_s"] for k in keys)
    cpu = sum(stats[f"{k}_cpu_s"] for k in keys)
    print(f"{'+'.join(keys)}: {wall:.1f} s wall, {cpu:.1f} s CPU (load {stats['load']:.1f} on {stats['cpus']} CPUs)")
    assert cpu < 10 * TIME_BUDGET_S, stats


def _check_budget(stats, plan):
    grown = stats["rss_after"] - stats["rss_before"]
    print(f"peak RSS +{grown / 2**20:.0f} MiB, planned {plan.param_bytes_per_rank / 2**30:.2f} GiB params per rank")
    _check_time(stats, ["plan"])
    assert grown < RSS_BUDGET_B, f"peak RSS grew by {grown / 2**20:.0f} MiB"
    # no real weights: one rank's planned parameters alone exceed what the planner allocated
    assert plan.param_bytes_per_rank > grown
    assert _total_bytes(plan) > 20 * 1024 ** 3                       # ~6B fp32 parameters planned
    assert not plan.fallbacks


def test_llama7b_1d_w8_budget(run_1d):
    stats, plan = run_1d
    _check_budget(stats, plan)
    assert plan.mesh.world_size == 8 and plan.mode == "1d"
    assert len(plan.params) == 32 * 9 + 3


def test_llama7b_1d_w8_param_bytes(run_1d):
    _, plan = run_1d
    assert all(p.dtype_bytes == 4 for p in plan.params)
    assert plan.param_bytes_per_rank == _sliced_bytes(plan, 0) == _sliced_bytes(plan, 7)
    # everything is split 8 ways except the norms (replicated): per rank = total/8 + 7/8 of the norms
    replicated = [p for p in plan.params if p.spec.is_replicated]
    assert replicated and all("norm" in p.name for p in replicated), [p.name for p in replicated]
    norm_bytes = sum(math.prod(p.global_shape) * 4 for p in replicated)
    assert norm_bytes == (2 * 32 + 1) * 4096 * 4
    assert plan.param_bytes_per_rank * 8 == _total_bytes(plan) + 7 * norm_bytes


def test_llama7b_25d_w64_d4_budget(run_25d):
    stats, plan = run_25d
    _check_budget(stats, plan)
    _check_time(stats, ["plan", "show"])
    assert plan.mesh.axes == ("dep", "row", "col") and plan.mesh.sizes == (4, 4, 4)
    assert "autoshard plan · LlamaForCausalLM · 2.5d" in stats["shown_head"]
    assert stats["shown_chars"] > 100_000                            # ~2k rows were printed


def test_llama7b_25d_w64_d4_param_bytes(run_25d):
    _, plan = run_25d
    assert plan.param_bytes_per_rank == _sliced_bytes(plan, 0) == _sliced_bytes(plan, 63) == _sliced_bytes(plan, 22)
    total = _total_bytes(plan)
    # Linear weights are split q² = 16 ways (replicated over depth); norms and the
    # embedding table only over col (4 ways)
    by_col_only = sum(math.prod(p.global_shape) * 4 for p in plan.params if p.spec.axes == ("col",))
    assert plan.param_bytes_per_rank * 16 == total + 3 * by_col_only
