"""CPU collectives on one host: gloo's TCP loopback against autoshard's shared-memory
transport (:mod:`autoshard.runtime.shm`), the measured reason the transport exists.

For each size (fp32 bytes per rank) and collective — all-reduce, all-gather and
reduce-scatter on the last dim, called through :mod:`autoshard.runtime.collectives`
as the kernels call them — both transports run alternately, each call after a
barrier, one thread per rank: median over steps of the slowest rank, the speed-up,
and the largest difference of their results (0 on 2 ranks; sums in another order on
more). 2 MiB is the activation of the efficiency benchmark's Llama (batch 8 × 128 ×
hidden 512, fp32), which a 1d step all-reduces 21 times.

    python benchmarks/bench_collectives.py                      # 2 and 4 ranks
    python benchmarks/bench_collectives.py --world 2 --sizes 2 --steps 50
"""

from __future__ import annotations

import argparse
import statistics

import _common


def main(argv=None) -> int:
    from rich.table import Table

    import _workers
    from dist_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="*", default=[2, 4], help="rank counts (one thread each)")
    ap.add_argument("--sizes", type=float, nargs="*", default=[0.5, 2, 8], help="MiB of fp32 per rank")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    sizes = [int(mb * (1 << 20)) // 64 * 64 for mb in args.sizes]
    con = _common.console(160)
    rows = []
    for world in args.world:
        per_rank = get_pool(world, timeout=1800).run(_workers.collectives_transport, sizes, args.steps, args.warmup)
        for key, r0 in per_rank[0].items():
            nbytes, kind = key
            med = {t: statistics.median(max(r[key]["times"][t][i] for r in per_rank) for i in range(args.steps))
                   for t in r0["times"]}
            rows.append({"world": world, "bytes": nbytes, "collective": kind, "gloo_s": med["gloo"],
                         "shm_s": med["shm"], "speedup": med["gloo"] / med["shm"],
                         "max_abs_diff": max(r[key]["max_abs_diff"] for r in per_rank)})
    t = Table(title="CPU collectives, one host: gloo vs shared memory (slowest rank, median)", header_style="bold")
    for c in ("ranks", "MiB / rank", "collective", "gloo ms", "shm ms", "speed-up", "max |diff|"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["world"]), f"{r['bytes'] / (1 << 20):g}", r["collective"], f"{r['gloo_s'] * 1e3:.2f}",
                  f"{r['shm_s'] * 1e3:.2f}", f"{r['speedup']:.1f}×", f"{r['max_abs_diff']:.1e}")
    con.print(t)
    path = _common.write_result("collectives", {"steps": args.steps, "rows": rows})
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
