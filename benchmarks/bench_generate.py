"""Per-token latency of ``generate`` on gloo: autoshard's sharded module (static KV
cache sharded as attention is, prefill and decode step graphs) vs the dense model vs
PyTorch's ``parallelize_module`` 1d (ColwiseParallel q/k/v/gate/up, RowwiseParallel
o/down, transformers' own cache) on the same tiny Llama, timed alternately in one
run per layout. Greedy, a batch of left-padded prompts; each figure is a run of
``--new`` tokens minus a run of one token over ``new - 1`` (prefill and set-up
cancel), median over ``--reps``, slowest rank. Also: tokens equal to dense, the
KV-cache bytes each rank holds against the decode plan's, collectives per token,
and the cost model's per-token prediction (``autoshard.planning.cost.forward_latency``) on a
cluster measured by ``autoshard.profile()`` on the same ranks first, and on the
``cpu-gloo`` preset.

    python benchmarks/bench_generate.py [--runs 1d:2 1d:4 2d:4 3d:8] [--new 16] [--reps 5]
"""

from __future__ import annotations

import argparse

import _common


def main(argv=None) -> int:
    from rich.table import Table

    import _workers
    from dist_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="*", default=["1d:2", "1d:4", "2d:4", "2.5d:8:2", "3d:8"],
                    help="mode:world[:depth] per run")
    _common.add_llama_args(ap, batch=4)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    cfg = _common.llama_config(args)
    con = _common.console(200)
    con.print(f"tiny Llama {cfg}; batch {args.batch} × prompt {args.prompt} (half left-padded), greedy, "
              f"{args.new} new tokens; fp32; 1 thread per rank; median of {args.reps}")
    rows = []
    for run in args.runs:
        mode, world, *depth = run.split(":")
        world, depth = int(world), (int(depth[0]) if depth else None)
        per_rank = get_pool(world, timeout=1800).run(_workers.generate_time, cfg, mode, depth, args.batch,
                                                     args.prompt, args.new, args.reps, mode == "1d")
        med = _common.slowest_medians(per_rank)
        r0 = per_rank[0]
        rows.append({"mode": mode, "world": world, "depth": depth, "median_s": med,
                     "equal": {k: all(r["equal"][k] for r in per_rank) for k in r0["equal"]},
                     "cache_bytes": [r["cache_bytes"] for r in per_rank],
                     "plan_cache_bytes": [r["plan_cache_bytes"] for r in per_rank],
                     "decode_calls": r0["decode_calls"], "decode_bytes": r0["decode_bytes"],
                     "captures": r0["captures"], "predicted_s": r0["predicted_s"]})
        con.print(f"[dim]{mode} on {world} ranks: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items())
                  + "[/dim]")
    t = Table(title="per-token latency of greedy generate (ms, slowest rank, median)", header_style="bold")
    for c in ("layout", "autoshard", "dense", "parallelize_module", "autoshard / dense", "autoshard / PM",
              "predicted (profile / preset)", "tokens = dense", "KV cache B/rank (= plan)", "calls/token", "comm B/token"):
        t.add_column(c, justify="right")
    for r in rows:
        m = r["median_s"]
        pm = m.get("parallelize_module")
        t.add_row(f"{r['mode']}@{r['world']}", f"{m['autoshard'] * 1e3:.1f}", f"{m['dense'] * 1e3:.1f}",
                  f"{pm * 1e3:.1f}" if pm else "-", f"{m['autoshard'] / m['dense']:.2f}",
                  f"{m['autoshard'] / pm:.2f}" if pm else "-", f"{r['predicted_s']['profiled'] * 1e3:.1f} / {r['predicted_s']['cpu-gloo'] * 1e3:.1f}",
                  " ".join(f"{k[:2]}:{'yes' if v else 'NO'}" for k, v in r["equal"].items()),
                  f"{r['cache_bytes'][0]:,} ({'=' if r['cache_bytes'] == r['plan_cache_bytes'] else '≠'})",
                  str(r["decode_calls"]), f"{r['decode_bytes']:,.0f}")
    con.print(t)
    path = _common.write_result("generate", {"model": cfg, "batch": args.batch, "prompt": args.prompt,
                                             "new": args.new, "reps": args.reps, "rows": rows})
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
