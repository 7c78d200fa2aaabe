"""Does the cost model rank layouts like the machine? Every candidate of one world size
(default 8 ranks) measured in one run next to its predicted step time.

The cluster is measured first with :func:`autoshard.profile` on the same ranks (all at
once, as the layouts run); each candidate of :func:`autoshard.planning.search.candidates` is
then sharded and timed (forward + backward + AdamW; the step's time is its slowest
rank's; median of ``--steps``) with the same global batch, cut over its dp replicas.
The table gives predicted / measured per candidate, the Spearman rank correlation
of the two orders, and where ``mode="auto"``'s pick lands, with dp pinned to 1 (what
``shard(mode="auto")`` searches) and free. Targets (issue 22): every ratio within
0.7-1.4, auto's pick within 10% of the measured best, Spearman >= 0.8.

    python benchmarks/bench_auto_choice.py [--world 8] [--steps 5] [--hidden 256]
"""

from __future__ import annotations

import argparse
import statistics

import _common


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties).

    >>> spearman([1, 2, 3], [10, 30, 20])
    0.5
    """
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else 0.0


def main(argv=None) -> int:
    from rich.table import Table

    import _workers
    from autoshard.planning.search import candidates
    from dist_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="global batch (cut over dp; 2+ rows per replica)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--modes", nargs="*", default=None, help="restrict the candidates' modes")
    ap.add_argument("--name", default="auto_choice", help="results/<name>.json")
    args = ap.parse_args(argv)
    cfg = dict(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
               num_attention_heads=8, num_key_value_heads=8, vocab_size=512, max_position_embeddings=256)
    con = _common.console(200)
    cands = [c for c in candidates(args.world, modes=args.modes) if args.batch % c.dp == 0]
    spec = [(c.mode, c.depth, c.dp, c.label) for c in cands]
    con.print(f"tiny Llama {cfg}; global batch {args.batch} × seq {args.seq}; {len(spec)} candidates at "
              f"{args.world} ranks; {args.steps} timed steps each after {args.warmup} warm-up")
    per_rank = get_pool(args.world, timeout=3600).run(_workers.auto_choice, cfg, args.batch, args.seq, args.steps,
                                                      args.warmup, spec, {})
    rows = []
    for i, (mode, depth, dp, label) in enumerate(spec):
        step = [max(r["runs"][i]["times"][k] for r in per_rank) for k in range(args.steps)]
        meas = statistics.median(step)
        pred = per_rank[0]["runs"][i]["predicted_s"]
        rows.append({"label": label, "mode": mode, "depth": depth, "dp": dp, "measured_s": meas, "predicted_s": pred,
                     "ratio": pred / meas, "steps_s": step, "predicted": per_rank[0]["runs"][i]["predicted"]})
    best = min(rows, key=lambda r: r["measured_s"])
    out = {"rows": rows, "cluster": per_rank[0]["cluster"], "config": cfg, "batch": args.batch, "seq": args.seq}
    t = Table(title=f"predicted vs measured step time · {args.world} gloo ranks · cluster from autoshard.profile()",
              header_style="bold")
    for c in ("candidate", "predicted ms", "measured ms", "pred / meas", "collective calls", "vs best"):
        t.add_column(c, justify="left" if c == "candidate" else "right")
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        ok = 0.7 <= r["ratio"] <= 1.4
        t.add_row(r["label"], f"{r['predicted_s'] * 1e3:.1f}", f"{r['measured_s'] * 1e3:.1f}",
                  f"[{'green' if ok else 'red'}]{r['ratio']:.2f}[/]", str(r["predicted"]["collective_calls"]),
                  f"{r['measured_s'] / best['measured_s']:.2f}×")
    con.print(t)
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    out["spearman"] = rho
    for key, pool in (("dp pinned to 1", [r for r in rows if r["dp"] == 1]), ("dp free", rows)):
        pick = min(pool, key=lambda r: r["predicted_s"])
        top = min(pool, key=lambda r: r["measured_s"])
        gap = pick["measured_s"] / top["measured_s"]
        out[f"pick {key}"] = {"pick": pick["label"], "best": top["label"], "gap": gap}
        con.print(f"auto ({key}): picks {pick['label']} ({pick['measured_s'] * 1e3:.1f} ms measured); measured best "
                  f"{top['label']} ({top['measured_s'] * 1e3:.1f} ms): {gap:.2f}× "
                  + ("[green]within 10%[/green]" if gap <= 1.10 else "[red]MISSES 10%[/red]"))
    in_band = sum(1 for r in rows if 0.7 <= r["ratio"] <= 1.4)
    con.print(f"Spearman {rho:.2f} ({'[green]>= 0.8[/green]' if rho >= 0.8 else '[red]< 0.8[/red]'}); "
              f"{in_band}/{len(rows)} candidates within 0.7-1.4")
    con.print(f"wrote {_common.write_result(args.name, out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
