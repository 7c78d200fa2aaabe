"""Tensor-parallel efficiency on this host: the dense model on one thread against p
gloo ranks of one thread each, per mode, and where each sharded step's time goes.

Efficiency = dense step time / (p × sharded step time): 1.0 is a perfect split of the
dense run over p cores. Every run is timed step by step alternately in one run per
world size (forward + backward + AdamW, the slowest rank's time per step, median over
steps), so drift in host load hits all alike. One more step of each run is profiled
(torch.profiler, CPU) and split by job: matmul compute, other compute (norms, rotary,
residuals, loss, copies), collectives (wall time of autoshard's collective ops,
waits included), the optimizer, and the rest of the wall time — framework overhead
(Python, dispatch, autograd bookkeeping, custom-op glue). The profiler slows a step
down; its shares, not its absolute times, are the breakdown.

The sharded models are made with ``gather_logits=False``, as a fine-tuning loop that reads
only the loss makes them (the vocab-parallel loss needs no gathered logits; Megatron and
torchtitan's ``loss_parallel`` keep them split too); ``--gather-logits`` gathers them.

    python benchmarks/bench_efficiency.py                       # Llama hidden 512, 4 layers, batch 8 × 128
    python benchmarks/bench_efficiency.py --world 2 --modes 1d --hidden 256 --layers 2 --seq 64 --steps 3
    python benchmarks/bench_efficiency.py --world 2 --modes 1d 1d-sp --async-tp 2   # plain and asynchronous
"""

from __future__ import annotations

import argparse
import math
import statistics

import _common

JOBS = ("matmul", "other_compute", "collectives", "optimizer", "overhead")


def main(argv=None) -> int:
    from rich.table import Table

    import _workers
    from dist_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="*", default=[2, 4], help="rank counts (one thread each)")
    ap.add_argument("--modes", nargs="*", default=["1d", "1d-sp", "2d"],
                    help="modes to time; a mode a world size cannot hold (2d on 2 ranks) is skipped")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    _common.add_llama_args(ap, batch=8, hidden=512, layers=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--async-tp", type=int, default=1, metavar="C",
                    help="also run 1d and 1d-sp with sharded.async_tp(C): their row-parallel all-reduces "
                         "(1d-sp: reduce-scatters) in C chunks")
    ap.add_argument("--gather-logits", action="store_true",
                    help="gather the vocab-split logits to every rank after each forward (shard()'s default)")
    args = ap.parse_args(argv)
    cfg = {**_common.llama_config(args), "vocab_size": args.vocab, "max_position_embeddings": max(256, args.seq)}
    con = _common.console(200)
    con.print(f"Llama {cfg}; batch {args.batch} × seq {args.seq}; fp32; forward + backward + AdamW; "
              f"{args.steps} timed steps after {args.warmup} warm-up, alternating; 1 thread per rank; "
              f"logits {'gathered' if args.gather_logits else 'left split (gather_logits=False)'}")
    rows = []
    for world in args.world:
        # 2d needs a square world of at least 4
        modes = [m for m in args.modes if m != "2d" or (world >= 4 and math.isqrt(world) ** 2 == world)]
        per_rank = get_pool(world, timeout=3600).run(_workers.efficiency, cfg, args.batch, args.seq, args.steps,
                                                     args.warmup, modes, args.async_tp,
                                                     args.gather_logits)
        r0 = per_rank[0]
        dense = statistics.median(r0["times"]["dense"])
        for mode, err in r0["errors"].items():
            rows.append({"world": world, "run": mode, "error": err})
        for name in r0["times"]:
            ts = r0["times"][name] if name == "dense" else \
                [max(r["times"][name][i] for r in per_rank) for i in range(args.steps)]
            med = statistics.median(ts)
            rows.append({"world": world, "run": name, "median_s": med, "times": ts, "loss": r0["losses"][name],
                         "efficiency": None if name == "dense" else dense / (world * med),
                         "breakdown": r0["breakdown"][name]})
        con.print(f"[dim]{world} ranks: dense {dense * 1e3:.0f} ms; "
                  + ", ".join(f"{r['run']} {r['median_s'] * 1e3:.0f} ms" for r in rows
                              if r["world"] == world and r["run"] != "dense" and "median_s" in r) + "[/dim]")
    t = Table(title="TP efficiency and where a step goes (profiled step on rank 0, share of its wall time)",
              header_style="bold")
    for c in ("ranks", "run", "step ms", "efficiency", "matmul", "other compute", "collectives", "optimizer",
              "overhead", "loss"):
        t.add_column(c, justify="right")
    for r in rows:
        if "error" in r:
            t.add_row(str(r["world"]), r["run"], "refused", r["error"], *[""] * 6)
            continue
        bd = r["breakdown"]
        t.add_row(str(r["world"]), r["run"], f"{r['median_s'] * 1e3:.0f}",
                  "" if r["efficiency"] is None else f"{r['efficiency']:.2f}",
                  *[f"{bd[j] / bd['step']:.0%}" for j in JOBS], f"{r['loss']:.4f}")
    con.print(t)
    path = _common.write_result("efficiency", {"model": cfg, "batch": args.batch, "seq": args.seq,
                                               "steps": args.steps, "gather_logits": args.gather_logits, "rows": rows})
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
