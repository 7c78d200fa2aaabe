"""Context parallelism (``shard(..., cp=C)``): step time and activation bytes per rank
against the sequence length, at a fixed number of ranks (default 4: cp 1 = 1d tp4,
cp 2 = tp2 × cp2, cp 4 = cp4 alone).

Activation bytes are what one forward saves for backward on rank 0, measured with
``saved_tensors_hooks`` (:class:`autoshard.planning.activations.SavedBytes`) next to the
plan's prediction (:func:`autoshard.planning.activations.saved_bytes`). Step time is
forward + backward + AdamW, the slowest rank's, median over steps, the cp layouts of
one length timed alternately. Each cp > 1 runs both attentions: ``ring`` (key/value
blocks sent around the cp ring, nothing whole) and ``gather`` (keys and values gathered
whole on every rank, so its saved bytes fall by less); the ring in both orders of the
sequence's blocks: ``balanced`` (rank r holds chunks r and 2C-1-r) and ``contiguous``
(rank r holds block r). "scores" is the most attention scores any rank's ring computed
in one forward (blocks the causal mask hides are skipped): the balanced order evens them.

    python benchmarks/bench_context_parallel.py                          # Llama hidden 256, 2 layers
    python benchmarks/bench_context_parallel.py --seqs 128 256 --cps 1 2 --world 2 --steps 2
"""

from __future__ import annotations

import argparse

import _common


def main(argv=None) -> int:
    from rich.table import Table

    import _workers
    from dist_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4, help="ranks (cp × tp)")
    ap.add_argument("--seqs", type=int, nargs="*", default=[128, 256, 512, 1024], help="sequence lengths")
    ap.add_argument("--cps", type=int, nargs="*", default=[1, 2, 4], help="context-parallel sizes (each divides --world)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    _common.add_llama_args(ap, batch=2, hidden=256, layers=2)
    args = ap.parse_args(argv)
    cfg = {**_common.llama_config(args), "max_position_embeddings": max(args.seqs)}
    con = _common.console(200)
    con.print(f"Llama {cfg}; batch {args.batch}; fp32; mode 1d on {args.world} ranks, tp = world / cp; "
              f"{args.steps} timed steps after {args.warmup} warm-up; 1 thread per rank")
    per_rank = get_pool(args.world, timeout=3600).run(_workers.context_parallel, cfg, args.batch, args.seqs,
                                                      args.cps, args.steps, args.warmup)
    med = _common.slowest_medians(per_rank)
    rows = []
    for s in args.seqs:
        ref = per_rank[0]["bytes"][f"{s}:{args.cps[0]}:ring:balanced"]["measured"]
        for key, by in per_rank[0]["bytes"].items():
            seq, cp, att, order = key.split(":")
            if int(seq) != s:
                continue
            cp = int(cp)
            scores = [r["bytes"][key]["scores"] for r in per_rank]
            rows.append({"seq": s, "cp": cp, "tp": args.world // cp, "attention": att if cp > 1 else "-",
                         "order": order if cp > 1 and att == "ring" else "-", "step_s": med[key], **by,
                         "scores_max": max(scores), "scores_min": min(scores),
                         "measured_vs_first_cp": by["measured"] / ref})
    t = Table(title=f"Context parallelism at {args.world} ranks: step time and saved activations per rank (rank 0)",
              header_style="bold")
    for c in ("seq", "cp × tp", "attention", "order", "step ms", "scores max/min rank", "saved (measured)",
              "saved (plan)", "plan / measured", f"vs cp={args.cps[0]}"):
        t.add_column(c, justify="right")
    for r in rows:
        ring = r["attention"] == "ring"
        t.add_row(str(r["seq"]), f"{r['cp']} × {r['tp']}", r["attention"], r["order"], f"{r['step_s'] * 1e3:.0f}",
                  f"{r['scores_max']:,} / {r['scores_min']:,}" if r["scores_max"] and ring else "-",
                  _common.human_bytes(r["measured"]),
                  _common.human_bytes(r["predicted"]), f"{r['predicted'] / r['measured']:.3f}",
                  f"{r['measured_vs_first_cp']:.3f}")
    con.print(t)
    path = _common.write_result("context_parallel", {"config": cfg, "batch": args.batch, "world": args.world,
                                                     "rows": rows})
    con.print(f"[dim]wrote {path}[/dim]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
