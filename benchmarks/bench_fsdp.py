"""ZeRO-1 / ZeRO-2 (autoshard's own, :mod:`autoshard.training.zero`) against torch's FSDP2
over the dp axis (``shard(..., fsdp=True)``, :mod:`autoshard.runtime.fsdp`): step time
and bytes per rank, in the same run, at 4 and 8 ranks.

Each world size runs one layout with dp = 2 (4 ranks: 1d tp2 × dp2; 8 ranks: 1d tp4 × dp2
and 2d q2 × dp2), four ways: plain AdamW (every replica holds all of its TP block's
parameters, gradients and AdamW state), ZeRO-1, ZeRO-2 and FSDP2. Bytes per rank are
measured on the tensors: parameters at rest, gradients after backward, optimizer state
after a step. Timed alternately step by step (the slowest rank's time, median over steps).

    python benchmarks/bench_fsdp.py                                  # Llama hidden 256, 4 layers
    python benchmarks/bench_fsdp.py --hidden 128 --layers 2 --steps 3 --runs 1d:4
"""

from __future__ import annotations

import argparse

import _common

RUNS = ("1d:4", "1d:8", "2d:8")


def main(argv=None) -> int:
    from rich.table import Table

    import _workers
    from dist_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="*", default=list(RUNS), help="MODE:WORLD layouts, each with dp = 2")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    _common.add_llama_args(ap, batch=8, hidden=256, layers=4)
    args = ap.parse_args(argv)
    cfg = _common.llama_config(args)
    con = _common.console(200)
    con.print(f"Llama {cfg}; batch {args.batch} × seq {args.seq}; fp32; forward + backward + AdamW; dp = 2; "
              f"{args.steps} timed steps after {args.warmup} warm-up, alternating; 1 thread per rank")
    rows = []
    for run in args.runs:
        mode, world = run.split(":")
        world = int(world)
        per_rank = get_pool(world, timeout=3600).run(_workers.zero_vs_fsdp, cfg, mode, 2, args.batch, args.seq,
                                                     args.steps, args.warmup)
        med = _common.slowest_medians(per_rank)
        dense = per_rank[0]["dense_param_bytes"]
        for name, t in med.items():
            by = per_rank[0]["bytes"][name]
            total = by["param_bytes"] + by["grad_bytes"] + by["optimizer_bytes"]
            rows.append({"mode": mode, "world": world, "dp": 2, "run": name, "step_s": t,
                         "loss": by["loss"], **{k: by[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")},
                         "total_bytes": total, "dense_param_bytes": dense,
                         "param_vs_dense_over_world": by["param_bytes"] / (dense / world)})
    t = Table(title="ZeRO vs FSDP2 over dp = 2: step time and bytes per rank (rank 0)", header_style="bold")
    for c in ("layout", "ranks", "run", "step ms", "params", "grads", "AdamW state", "total",
              "params / (dense/ranks)", "loss"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(f"{r['mode']} × dp2", str(r["world"]), r["run"], f"{r['step_s'] * 1e3:.0f}",
                  _common.human_bytes(r["param_bytes"]), _common.human_bytes(r["grad_bytes"]),
                  _common.human_bytes(r["optimizer_bytes"]), _common.human_bytes(r["total_bytes"]),
                  f"{r['param_vs_dense_over_world']:.3f}", f"{r['loss']:.4f}")
    con.print(t)
    path = _common.write_result("fsdp", {"config": cfg, "batch": args.batch, "seq": args.seq, "rows": rows})
    con.print(f"[dim]wrote {path}[/dim]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
