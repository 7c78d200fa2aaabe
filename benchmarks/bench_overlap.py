"""Collectives overlapped (issue 22): training-step time (forward + backward + AdamW)
of the same layout, weights and batch with every collective one after the other
(``sequential``); with a SUMMA / 3D Linear's two operand all-gathers and two gradient
reduce-scatters in flight together (``paired``, the default,
:func:`autoshard.runtime.parallel_ops.paired_collectives`); with each SUMMA / 3D weight gather also
launched one Linear early (``sharded.prefetch_weights()``); and with the gradient
all-reduces in asynchronous buckets during backward (``sharded.overlap_grad_sync(bucket_bytes)``).
Timed alternately step by step in one run per layout (slowest rank, median). Also the
collective calls per step and the losses (equal: every path is exact).

    python benchmarks/bench_overlap.py [--layouts 1d:4:2 2d:4:1 2.5d:8:1:2 3d:8:1] [--steps 10]
"""

from __future__ import annotations

import argparse

import _common


def main(argv=None) -> int:
    from rich.table import Table

    import _workers
    from dist_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", nargs="*", default=["1d:4:2", "2d:4:1", "2.5d:8:1:2", "3d:8:1", "1d:8:4"],
                    help="mode:world:dp[:depth] per run")
    ap.add_argument("--buckets", type=int, nargs="*", default=[1 << 16, 1 << 22], help="bucket sizes in bytes")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    _common.add_llama_args(ap, batch=8)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    cfg = _common.llama_config(args)
    con = _common.console(200)
    con.print(f"tiny Llama {cfg}; global batch {args.batch} × seq {args.seq}; fp32; gloo; {args.steps} steps after "
              f"{args.warmup} warm-up, alternated")
    rows = []
    for spec in args.layouts:
        mode, world, dp, *depth = spec.split(":")
        world, dp, depth = int(world), int(dp), (int(depth[0]) if depth else None)
        per_rank = get_pool(world, timeout=1800).run(_workers.overlap_time, cfg, mode, dp, args.batch, args.seq,
                                                     args.steps, args.warmup, args.buckets, depth)
        r0 = per_rank[0]
        med = _common.slowest_medians(per_rank)
        base = med["sequential"]
        for k, v in med.items():
            rows.append({"layout": f"{mode}@{world} dp{dp}", "sync": k, "median_s": v, "vs_sequential": v / base,
                         "calls": r0["calls"][k], "loss": r0["losses"][k]})
        con.print(f"[dim]{spec}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in med.items()) + "[/dim]")
    t = Table(title="training step: collectives one after the other vs paired / bucketed + overlapped "
                    "(slowest rank, median)", header_style="bold")
    for c in ("layout", "collectives", "ms", "vs sequential", "collectives/step", "loss"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["layout"], r["sync"], f"{r['median_s'] * 1e3:.0f}", f"{r['vs_sequential']:.2f}",
                  str(r["calls"]), f"{r['loss']:.6f}")
    con.print(t)
    path = _common.write_result("overlap", {"model": cfg, "batch": args.batch, "seq": args.seq, "rows": rows})
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
