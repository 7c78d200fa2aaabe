"""Training-step time on gloo: autoshard 1d vs PyTorch's own tensor parallelism
(``torch.distributed.tensor.parallel.parallelize_module`` with ColwiseParallel on
q/k/v/gate/up and RowwiseParallel on o/down, written by hand) on the same tiny
Llama, same batch, same process group. Both are timed alternately step by step in
one run (forward + backward + AdamW), so host-load drift hits both alike; the
result is the ratio of medians.

Not the same work: autoshard also splits the embedding and the LM head
(vocab-parallel, with a vocab-parallel cross-entropy); the hand-written DTensor
plan leaves them replicated, as PyTorch's Llama examples do for a minimal plan.

    python benchmarks/bench_step_time.py [--world 2 4] [--steps 30] [--hidden 256]
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
    ap.add_argument("--world", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    cfg = dict(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
               num_attention_heads=8, num_key_value_heads=8, vocab_size=512, max_position_embeddings=256)
    con = _common.console(200)
    con.print(f"tiny Llama {cfg}; batch {args.batch} × seq {args.seq}; fp32; {args.steps} timed steps each "
              f"after {args.warmup} warm-up; 1 thread per rank")
    rows = []
    for world in args.world:
        per_rank = get_pool(world, timeout=1800).run(_workers.step_time, cfg, args.batch, args.seq, args.steps,
                                                     args.warmup)
        # the step's time is its slowest rank's
        ours = [max(r["times"]["autoshard"][i] for r in per_rank) for i in range(args.steps)]
        ref = [max(r["times"]["dtensor"][i] for r in per_rank) for i in range(args.steps)]
        mo, mr = statistics.median(ours), statistics.median(ref)
        rows.append({"world": world, "autoshard_median_s": mo, "dtensor_median_s": mr, "ratio": mo / mr,
                     "autoshard_times": ours, "dtensor_times": ref, "losses": per_rank[0]["losses"],
                     "autoshard_local_params": per_rank[0]["ours_params"],
                     "dtensor_local_params": per_rank[0]["ref_local_params"]})
        con.print(f"[dim]{world} ranks: autoshard {mo * 1e3:.1f} ms, DTensor {mr * 1e3:.1f} ms[/dim]")
    t = Table(title="step time (forward + backward + AdamW), median over steps, slowest rank", header_style="bold")
    for c in ("ranks", "autoshard 1d ms", "DTensor TP ms", "autoshard / DTensor", "local params (ours / DTensor)",
              "loss (ours / DTensor)"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["world"]), f"{r['autoshard_median_s'] * 1e3:.1f}", f"{r['dtensor_median_s'] * 1e3:.1f}",
                  f"{r['ratio']:.2f}", f"{r['autoshard_local_params']:,} / {r['dtensor_local_params']:,}",
                  f"{r['losses']['autoshard']:.4f} / {r['losses']['dtensor']:.4f}")
    con.print(t)
    path = _common.write_result("step_time", {"model": cfg, "batch": args.batch, "seq": args.seq,
                                              "steps": args.steps, "rows": rows})
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
