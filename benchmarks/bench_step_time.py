"""Training-step time on gloo: autoshard 1d vs PyTorch's own tensor parallelism
(``torch.distributed.tensor.parallel.parallelize_module`` with ColwiseParallel on
q/k/v/gate/up and RowwiseParallel on o/down, written by hand) on the same tiny
Llama, same batch, same process group. Both are timed alternately step by step in
one run (forward + backward + AdamW), so host-load drift hits both alike; the
result is the ratio of medians.

Not the same work: autoshard also splits the embedding and the LM head
(vocab-parallel, with a vocab-parallel cross-entropy); the hand-written DTensor
plan leaves them replicated, as PyTorch's Llama examples do for a minimal plan.

A second table times more layouts alternately in one run per world size:
autoshard 1d and 1d-sp (sequence parallelism) next to PyTorch's
``parallelize_module`` without and with ``SequenceParallel`` (the torchtitan
layout: Shard(1) embedding / Rowwise outputs, SequenceParallel norms,
PrepareModuleInput gathering the attention and MLP inputs, the LM head reading
Shard(1)), and, where the world size allows tp2 × dp, autoshard 1d with the AdamW
state plain, ZeRO-1 and ZeRO-2 over dp (its optimizer bytes per rank too).

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
    layouts = []
    for world in args.world:
        variants = [("autoshard", "1d", 1, 0), ("autoshard", "1d-sp", 1, 0), ("dtensor", False), ("dtensor", True)]
        if world >= 4 and world % 2 == 0:
            variants += [("autoshard", "1d", 2, z) for z in (0, 1, 2)]
        per_rank = get_pool(world, timeout=1800).run(_workers.step_time_variants, cfg, args.batch, args.seq,
                                                     args.steps, args.warmup, variants)
        for label, err in per_rank[0]["errors"].items():
            layouts.append({"world": world, "layout": label, "error": err})
        for label in per_rank[0]["times"]:
            ts = [max(r["times"][label][i] for r in per_rank) for i in range(args.steps)]
            layouts.append({"world": world, "layout": label, "median_s": statistics.median(ts), "times": ts,
                            "loss": per_rank[0]["losses"][label],
                            "optimizer_bytes": per_rank[0]["optimizer_bytes"][label]})
    t2 = Table(title="more layouts, timed alternately in one run per world size (slowest rank, median)",
               header_style="bold")
    for c in ("ranks", "layout", "ms", "vs DTensor TP", "AdamW state bytes/rank", "loss"):
        t2.add_column(c, justify="right")
    names = {"autoshard/1d/1/0": "autoshard 1d", "autoshard/1d-sp/1/0": "autoshard 1d-sp",
             "dtensor/False": "DTensor TP", "dtensor/True": "DTensor TP + SequenceParallel",
             "autoshard/1d/2/0": "autoshard 1d tp×dp2", "autoshard/1d/2/1": "autoshard 1d tp×dp2 ZeRO-1",
             "autoshard/1d/2/2": "autoshard 1d tp×dp2 ZeRO-2"}
    for r in layouts:
        if "error" in r:
            t2.add_row(str(r["world"]), names.get(r["layout"], r["layout"]), "failed", r["error"], "", "")
            continue
        base = next((x["median_s"] for x in layouts if x["world"] == r["world"] and x["layout"] == "dtensor/False"
                     and "median_s" in x), None)
        t2.add_row(str(r["world"]), names.get(r["layout"], r["layout"]), f"{r['median_s'] * 1e3:.1f}",
                   f"{r['median_s'] / base:.2f}" if base else "", f"{r['optimizer_bytes']:,}", f"{r['loss']:.4f}")
    con.print(t2)
    path = _common.write_result("step_time", {"model": cfg, "batch": args.batch, "seq": args.seq,
                                              "steps": args.steps, "rows": rows, "layouts": layouts})
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
