"""Does micro-pipelined (asynchronous) tensor parallelism pay on this host?

The 1d row-parallel Linear (attention output, MLP down projection) multiplies its
local features and sums the partial product over the ranks. Asynchronous TP cuts the
rows into chunks and launches each chunk's all-reduce while the next chunk
multiplies, so communication hides behind compute where the two can run at once
(on GPUs: NCCL kernels beside the GEMMs). This benchmark times that primitive on
the host's gloo ranks, plain (one product, one blocking all-reduce, as autoshard
runs it) against 2 and 4 chunks, alternately, at the shapes of the issue's Llama
(batch 8 × 128 rows, hidden 512: the attention output's k = 512/p, the MLP down
projection's k = 2048/p, n = 512): median over steps of the slowest rank, and the
largest difference of the chunked result from the plain one.

A second table times whole 1d training steps (forward + backward + AdamW) of that
Llama (4 layers, vocabulary 4096) plain and with ``sharded.async_tp(c)``, alternately:
the gain where it counts, next to :func:`autoshard.planning.cost.estimate`'s
prediction (``async_tp=c``, the ``cpu-gloo`` preset).

    python benchmarks/bench_async_tp.py                 # 2 ranks
    python benchmarks/bench_async_tp.py --world 2 4 --steps 30 --step-steps 5
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
    ap.add_argument("--world", type=int, nargs="*", default=[2], help="rank counts (one thread each)")
    ap.add_argument("--rows", type=int, default=8 * 128, help="rows of the product (batch × sequence)")
    ap.add_argument("--hidden", type=int, default=512, help="n, and the attention output's k before the split")
    ap.add_argument("--mlp", type=int, default=2048, help="the down projection's k before the split")
    ap.add_argument("--chunks", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--step-steps", type=int, default=5, help="timed training steps per variant (0: skip)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args(argv)
    con = _common.console(160)
    rows = []
    for world in args.world:
        ks = [args.hidden // world, args.mlp // world]
        per_rank = get_pool(world, timeout=1800).run(_workers.async_tp_primitive, args.rows, ks, args.hidden,
                                                     args.chunks, args.steps, args.warmup)
        for k in ks:
            names = list(per_rank[0][k]["times"])
            med = {nm: statistics.median(max(r[k]["times"][nm][i] for r in per_rank) for i in range(args.steps))
                   for nm in names}
            for nm in names:
                rows.append({"world": world, "k": k, "n": args.hidden, "rows": args.rows, "run": nm,
                             "median_s": med[nm], "vs_plain": med[nm] / med["plain"],
                             "max_abs_diff": max(r[k]["max_abs_diff"] for r in per_rank)})
    t = Table(title="Row-parallel product + all-reduce: plain vs micro-pipelined (slowest rank, median)",
              header_style="bold")
    for c in ("ranks", "rows×k @ k×n", "run", "ms", "vs plain", "max |diff|"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["world"]), f"{r['rows']}×{r['k']} @ {r['k']}×{r['n']}", r["run"],
                  f"{r['median_s'] * 1e3:.2f}", f"{r['vs_plain']:.2f}", f"{r['max_abs_diff']:.1e}")
    con.print(t)
    steps = []
    if args.step_steps:
        import autoshard
        import transformers
        from autoshard.planning.cost import estimate

        cfg = dict(hidden_size=args.hidden, intermediate_size=args.mlp, num_hidden_layers=args.layers,
                   num_attention_heads=8, num_key_value_heads=8, vocab_size=args.vocab,
                   max_position_embeddings=max(256, args.rows // 8))
        b, s = 8, args.rows // 8
        for world in args.world:
            per_rank = get_pool(world, timeout=3600).run(_workers.async_tp_step, cfg, b, s, args.chunks,
                                                         args.step_steps, 2)
            plan = autoshard.plan(transformers.LlamaConfig(**cfg), world_size=world, mode="1d", batch_size=b,
                                  seq_len=s)
            med = {nm: statistics.median(max(r["times"][nm][i] for r in per_rank) for i in range(args.step_steps))
                   for nm in per_rank[0]["times"]}
            base = estimate(plan, "cpu-gloo").step_s
            for nm, v in med.items():
                c = 1 if nm == "plain" else int(nm.split("(")[1].rstrip(")"))
                steps.append({"world": world, "run": nm, "median_s": v, "vs_plain": v / med["plain"],
                              "loss": per_rank[0]["losses"][nm],
                              "predicted_vs_plain": estimate(plan, "cpu-gloo", async_tp=c).step_s / base})
        t2 = Table(title=f"1d training step, Llama hidden {args.hidden}, {args.layers} layers, batch {b} × {s} "
                         f"(slowest rank, median)", header_style="bold")
        for c in ("ranks", "run", "step ms", "vs plain", "predicted (cpu-gloo)", "loss"):
            t2.add_column(c, justify="right")
        for r in steps:
            t2.add_row(str(r["world"]), r["run"], f"{r['median_s'] * 1e3:.0f}", f"{r['vs_plain']:.3f}",
                       f"{r['predicted_vs_plain']:.3f}", f"{r['loss']:.5f}")
        con.print(t2)
    path = _common.write_result("async_tp", {"rows": rows, "steps": args.steps, "training_steps": steps})
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
