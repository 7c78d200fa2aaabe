"""Planning time and peak RSS for Llama 7B / 13B / 70B shapes at 64, 512 and 4096
ranks, mode 2.5d (a valid depth) and 1d; each plan in a fresh interpreter.

The child process reports the time of ``import autoshard`` and of one
``autoshard.plan(...)`` call (meta device: no weights), its peak RSS, and the
number of nodes and fallbacks. Targets (issue 22; wall time of the whole child: interpreter,
imports and plan, on the idle 2-core machine): 7B at 64 ranks <= 8 s, 70B at 4096 ranks <= 15 s,
peak RSS < 1 GiB. A deep model is planned from a 3-layer export stamped to its depth
(autoshard.passes.stamp); the first plan of a shape exports, later ones hit the capture cache.

    python benchmarks/bench_planning.py [--models llama:7b llama:70b] [--worlds 64 4096] [--modes 2.5d 1d]

``--auto`` times the search instead (issue 56): ``autoshard plan MODEL --world-size N --mode auto``
for llama:7b at 64 ranks and llama:70b at 4096 (``--runs``), cold (an empty capture cache), in a
fresh process each, its wall and user CPU seconds (``os.wait4``: other jobs on the shared machine
inflate wall time, much less user time), against the targets 8 s and 30 s; results/planning_auto.json.

    python benchmarks/bench_planning.py --auto [--runs llama:7b:64 llama:70b:4096] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

import _common

TARGET_S = 60.0                                              # the round-1 bound, kept in the JSON
TARGETS_WALL_S = {("llama:7b", 64): 8.0, ("llama:70b", 4096): 15.0}
RSS_TARGET_B = 1 << 30

_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import autoshard
from autoshard.cli import resolve_model
t1 = time.perf_counter()
kw = json.loads(sys.argv[1])
cfg = resolve_model(kw.pop("model"))
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t2 = time.perf_counter()
plan = autoshard.plan(cfg, **kw)
t3 = time.perf_counter()
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"import_s": t1 - t0, "plan_s": t3 - t2, "rss_before": rss0, "rss_peak": rss1,
                  "mesh": str(plan.mesh), "nodes": len(plan.nodes), "fallbacks": len(plan.fallbacks),
                  "param_bytes_per_rank": plan.param_bytes_per_rank}))
"""


def depth_for(model: str, world: int) -> tuple[int, int] | None:
    """(q, d) with d ≥ 2, q dividing the (kv) heads, q and d as close as possible."""
    from autoshard.cli import resolve_model

    cfg = resolve_model(model)
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    best = None
    for q in range(2, math.isqrt(world) + 1):
        if world % (q * q) or heads % q or kv % q:
            continue
        d = world // (q * q)
        if d < 2:
            continue
        key = (abs(math.log(q) - math.log(d)), -q)
        if best is None or key < best[0]:
            best = (key, (q, d))
    return best[1] if best else None


def run_one(model: str, world: int, mode: str, timeout: float) -> dict:
    if mode == "2.5d":
        qd = depth_for(model, world)
        if qd is None:
            return {"error": "no valid depth"}
        q, d = qd
        kw = dict(model=model, world_size=world, mode=mode, depth=d, batch_size=d * q, seq_len=2048)
    else:
        q, d = world, 1
        kw = dict(model=model, world_size=world, mode=mode, batch_size=8, seq_len=2048)
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(kw)], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s", "wall_s": time.perf_counter() - t0, "q": q, "d": d}
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"error": p.stderr.strip().splitlines()[-1][:300] if p.stderr.strip() else f"rc {p.returncode}",
                "wall_s": wall, "q": q, "d": d, "kw": kw}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out.update(wall_s=wall, q=q, d=d, kw=kw)
    return out


def main_auto(args) -> int:
    """``--auto``: the cold search's wall and user seconds (one fresh process per run)."""
    import os
    import tempfile

    from rich.table import Table

    from bench_plan import TARGETS_WALL_S as AUTO_TARGETS, _run

    con = _common.console(200)
    rows = []
    for spec in args.runs:
        model, world = spec.rsplit(":", 1)
        for i in range(args.repeat):
            with tempfile.TemporaryDirectory() as cache:        # cold: nothing captured yet
                r = _run(model, int(world), cache=cache, priced=True)
            r.update(run=i + 1, target_s=AUTO_TARGETS.get((model, int(world))), loadavg=os.getloadavg()[0])
            rows.append(r)
            con.print(f"[dim]{model} {world}: wall {r['wall_s']:.1f} s, user {r['user_s']:.1f} s[/dim]")
    t = Table(title="autoshard plan MODEL --world-size N --mode auto, cold (fresh process, empty capture cache)",
              header_style="bold")
    for c in ("model", "ranks", "run", "wall s", "user s", "sys s", "target s", "load avg", "chosen"):
        t.add_column(c, justify="left" if c in ("model", "chosen") else "right")
    for r in rows:
        tgt = r["target_s"]
        mark = "" if tgt is None else (f"[green]{tgt:g} (user met)[/green]" if r["user_s"] <= tgt
                                       else f"[red]{tgt:g} (user misses)[/red]")
        t.add_row(r["model"], str(r["world"]), str(r["run"]), f"{r['wall_s']:.1f}", f"{r['user_s']:.1f}",
                  f"{r['sys_s']:.1f}", mark, f"{r['loadavg']:.1f}", r["chosen"] or f"[red]rc {r['rc']}[/red]")
    con.print(t)
    path = _common.write_result(args.name if args.name != "planning" else "planning_auto", {"rows": rows})
    con.print(f"wrote {path}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


def main(argv=None) -> int:
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=["llama:7b", "llama:13b", "llama:70b"])
    ap.add_argument("--worlds", nargs="*", type=int, default=[64, 512, 4096])
    ap.add_argument("--modes", nargs="*", default=["2.5d", "1d"])
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--name", default="planning", help="results/<name>.json")
    ap.add_argument("--auto", action="store_true", help="time the cold --mode auto search instead (--runs)")
    ap.add_argument("--runs", nargs="+", default=["llama:7b:64", "llama:70b:4096"], help="with --auto: MODEL:WORLD")
    ap.add_argument("--repeat", type=int, default=1, help="with --auto: runs of each")
    args = ap.parse_args(argv)
    if args.auto:
        return main_auto(args)
    con = _common.console(200)
    rows = []
    for model in args.models:
        for world in args.worlds:
            for mode in args.modes:
                r = run_one(model, world, mode, args.timeout)
                r.update(model=model, world=world, mode=mode)
                rows.append(r)
                con.print(f"[dim]{model} {world} {mode}: "
                          + (f"plan {r['plan_s']:.1f} s, wall {r['wall_s']:.1f} s, peak RSS "
                             f"{_common.human_bytes(r['rss_peak'])}" if "plan_s" in r else r["error"]) + "[/dim]")
                _common.write_result(args.name, {"rows": rows, "partial": True})
    t = Table(title="planning time and peak RSS (fresh interpreter per plan; meta device)", header_style="bold")
    for c in ("model", "ranks", "mode", "mesh", "batch", "import s", "plan s", "wall s", "peak RSS", "nodes",
              "fallbacks", "note"):
        t.add_column(c, justify="left" if c in ("model", "mode", "mesh", "note") else "right")
    for r in rows:
        if "plan_s" in r:
            note = ""
            goal = TARGETS_WALL_S.get((r["model"], r["world"]))
            if goal is not None:
                ok = r["wall_s"] <= goal and r["rss_peak"] < RSS_TARGET_B
                note = (f"[green]<= {goal:.0f} s wall, < 1 GiB: met[/green]" if ok
                        else f"[red]MISSES <= {goal:.0f} s wall / < 1 GiB[/red]")
            t.add_row(r["model"], str(r["world"]), r["mode"], r["mesh"], str(r["kw"]["batch_size"]),
                      f"{r['import_s']:.1f}", f"{r['plan_s']:.1f}", f"{r['wall_s']:.1f}",
                      _common.human_bytes(r["rss_peak"]), str(r["nodes"]), str(r["fallbacks"]), note)
        else:
            t.add_row(r["model"], str(r["world"]), r["mode"], "-", "-", "-", "-", f"{r.get('wall_s', 0):.1f}", "-",
                      "-", "-", f"[red]{r['error']}[/red]")
    con.print(t)
    path = _common.write_result(args.name, {"rows": rows, "target_s": TARGET_S, "partial": False,
                                            "targets_wall_s": {f"{m}@{w}": v for (m, w), v in TARGETS_WALL_S.items()},
                                            "rss_target_b": RSS_TARGET_B})
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
