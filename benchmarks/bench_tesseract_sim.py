"""Simulate the Tesseract paper's Table 1 (strong scaling) and Table 2 (weak
scaling) with the cost model on the ``tesseract-paper`` cluster preset.

Each row of the tables (method, GPU shape, batch, hidden, heads) is planned by
autoshard on a Transformer of that shape (GPT-2 blocks: LayerNorm, attention,
4h MLP) and its training step is predicted by ``autoshard.cost.estimate``. The
predicted ratios between Megatron 1D, Optimus 2D and Tesseract 2.5D are printed
next to the ratios measured in the paper.

What the paper does not state and is assumed here: sequence length
(``--seq-len``, default 1024, Megatron-LM's GPT-2 default, the code the paper
compares against; a sweep over 128..2048 is printed too), number of layers (the
ratios do not depend on it; 2 are planned), vocabulary (128: the paper times
Transformer layers on random inputs, so the embedding and LM head are made
negligible), dtype (fp32).

Two predictions per row: autoshard's plan as it runs (2.5D all-reduces weight
gradients over depth), and "paper's code": the same plan without that depth
all-reduce, which the reference implementation omits (DESIGN §4), i.e. what the
paper's Tesseract rows actually timed.

Where a row's batch does not split over the mode's batch blocks (batch 12 on
Optimus [8,8]), the cost model, which is affine in the batch, is evaluated at the
two nearest batches that split and interpolated.

    python benchmarks/bench_tesseract_sim.py [--seq-len 512] [--layers 2]
"""

from __future__ import annotations

import argparse
import time

import _common  # noqa: F401  (sys.path)

# (method, mode, shape, batch, hidden, heads, paper fwd s, paper bwd s, paper throughput = 1 / (fwd + bwd), it/s)
TABLE1 = [
    ("Megatron-LM", "1d", (4,), 12, 3072, 64, 0.1225, 0.4749, 1.6739),
    ("Megatron-LM", "1d", (16,), 12, 3072, 64, 0.1143, 0.4293, 1.8396),
    ("Megatron-LM", "1d", (64,), 12, 3072, 64, 0.1195, 0.5306, 1.5382),
    ("Optimus", "2d", (2, 2), 12, 3072, 64, 0.1676, 0.5019, 1.4937),
    ("Optimus", "2d", (4, 4), 12, 3072, 64, 0.2099, 0.6159, 1.2109),
    ("Optimus", "2d", (8, 8), 12, 3072, 64, 0.1329, 0.3986, 1.8815),
    ("Tesseract", "2.5d", (2, 2, 1), 12, 3072, 64, 0.1666, 0.5014, 1.4970),
    ("Tesseract", "2.5d", (2, 2, 2), 12, 3072, 64, 0.0999, 0.3002, 2.4994),
    ("Tesseract", "2.5d", (4, 4, 1), 12, 3072, 64, 0.1444, 0.4343, 1.7280),
    ("Tesseract", "2.5d", (4, 4, 2), 12, 3072, 64, 0.1244, 0.3727, 2.0117),
    ("Tesseract", "2.5d", (4, 4, 4), 16, 3072, 64, 0.0869, 0.2636, 2.8531),
    ("Tesseract", "2.5d", (8, 8, 1), 12, 3072, 64, 0.1799, 0.5178, 1.4333),
]
TABLE2 = [
    ("Megatron-LM", "1d", (4,), 60, 2048, 32, 0.0793, 0.2613, 2.9360),
    ("Megatron-LM", "1d", (16,), 60, 4096, 64, 0.2081, 0.5149, 1.3831),
    ("Megatron-LM", "1d", (64,), 30, 8192, 128, 0.4638, 1.0963, 0.6410),
    ("Optimus", "2d", (2, 2), 96, 2048, 32, 0.0827, 0.2445, 3.0562),
    ("Optimus", "2d", (4, 4), 192, 4096, 64, 0.1829, 0.5458, 1.3723),
    ("Optimus", "2d", (8, 8), 384, 8192, 128, 0.1962, 0.5964, 1.2617),
    ("Tesseract", "2.5d", (1, 1, 1), 48, 1024, 16, 0.0603, 0.1669, 4.4014),
    ("Tesseract", "2.5d", (2, 2, 1), 96, 2048, 32, 0.0867, 0.2557, 2.9206),
    ("Tesseract", "2.5d", (2, 2, 2), 192, 2048, 32, 0.0864, 0.2552, 2.9274),
    ("Tesseract", "2.5d", (4, 4, 1), 192, 4096, 64, 0.1177, 0.3553, 2.1142),
    ("Tesseract", "2.5d", (4, 4, 2), 384, 4096, 64, 0.1173, 0.3521, 2.1304),
    ("Tesseract", "2.5d", (4, 4, 4), 768, 4096, 64, 0.1155, 0.3468, 2.1631),
    # the paper prints exactly Table 1's [8,8,1] numbers here (batch 12, hidden 3072):
    # most likely a copy slip; kept as printed, flagged in the output
    ("Tesseract", "2.5d", (8, 8, 1), 384, 8192, 128, 0.1799, 0.5178, 1.4333),
]

# Ratios compared: (label, numerator row, denominator row) of the paper's "throughput"
# column, which is 1 / (forward + backward time per batch), i.e. iterations per
# second (Table 1, Megatron [4]: 1 / (0.1225 + 0.4749) = 1.674), not sequences/s.
def _key(method, shape):
    return f"{method} {list(shape)}"


COMPARE = {
    "table1": [
        ("64 GPUs: Tesseract[4,4,4] / Megatron[64]", ("Tesseract", (4, 4, 4)), ("Megatron-LM", (64,))),
        ("64 GPUs: Tesseract[4,4,4] / Optimus[8,8]", ("Tesseract", (4, 4, 4)), ("Optimus", (8, 8))),
        ("64 GPUs: Tesseract[4,4,4] / Tesseract[8,8,1]", ("Tesseract", (4, 4, 4)), ("Tesseract", (8, 8, 1))),
        ("64 GPUs: Optimus[8,8] / Megatron[64]", ("Optimus", (8, 8)), ("Megatron-LM", (64,))),
        ("16 GPUs: Tesseract[4,4,1] / Megatron[16]", ("Tesseract", (4, 4, 1)), ("Megatron-LM", (16,))),
        ("16 GPUs: Tesseract[4,4,1] / Optimus[4,4]", ("Tesseract", (4, 4, 1)), ("Optimus", (4, 4))),
        ("4 GPUs: Tesseract[2,2,1] / Megatron[4]", ("Tesseract", (2, 2, 1)), ("Megatron-LM", (4,))),
        ("4 GPUs: Tesseract[2,2,1] / Optimus[2,2]", ("Tesseract", (2, 2, 1)), ("Optimus", (2, 2))),
        ("depth: Tesseract[2,2,2] / Tesseract[2,2,1]", ("Tesseract", (2, 2, 2)), ("Tesseract", (2, 2, 1))),
        ("depth: Tesseract[4,4,2] / Tesseract[4,4,1]", ("Tesseract", (4, 4, 2)), ("Tesseract", (4, 4, 1))),
        ("depth: Tesseract[4,4,4] / Tesseract[4,4,1]", ("Tesseract", (4, 4, 4)), ("Tesseract", (4, 4, 1))),
    ],
    "table2": [
        ("64 GPUs: Tesseract[4,4,4] / Megatron[64]", ("Tesseract", (4, 4, 4)), ("Megatron-LM", (64,))),
        ("64 GPUs: Tesseract[4,4,4] / Optimus[8,8]", ("Tesseract", (4, 4, 4)), ("Optimus", (8, 8))),
        ("64 GPUs: Tesseract[4,4,4] / Tesseract[8,8,1]*", ("Tesseract", (4, 4, 4)), ("Tesseract", (8, 8, 1))),
        ("16 GPUs: Tesseract[4,4,1] / Megatron[16]", ("Tesseract", (4, 4, 1)), ("Megatron-LM", (16,))),
        ("16 GPUs: Tesseract[4,4,1] / Optimus[4,4]", ("Tesseract", (4, 4, 1)), ("Optimus", (4, 4))),
        ("4 GPUs: Tesseract[2,2,1] / Megatron[4]", ("Tesseract", (2, 2, 1)), ("Megatron-LM", (4,))),
        ("4 GPUs: Tesseract[2,2,1] / Optimus[2,2]", ("Tesseract", (2, 2, 1)), ("Optimus", (2, 2))),
        ("depth: Tesseract[4,4,4] / Tesseract[4,4,1]", ("Tesseract", (4, 4, 4)), ("Tesseract", (4, 4, 1))),
    ],
}
TOLERANCE = 0.30


def _capture(hidden: int, heads: int, layers: int, vocab: int, seq: int):
    import transformers

    from autoshard.api import _model_from
    from autoshard.passes.capture import capture

    cfg = transformers.GPT2Config(n_embd=hidden, n_head=heads, n_layer=layers, vocab_size=vocab,
                                  n_positions=max(seq, 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  architectures=["GPT2LMHeadModel"])
    m = _model_from(cfg)
    m.train()
    return capture(m)


def _policy(mode: str, shape: tuple):
    from autoshard.policies import POLICIES

    world = 1
    for s in shape:
        world *= s
    if world == 1:
        mode, depth = "1d", None
    elif mode == "2.5d":
        depth = shape[2]
    else:
        depth = None
    cls = POLICIES[mode]
    return cls(cls.make_mesh(world, depth=depth, dp=1))


def _without_depth_sync(plan):
    import dataclasses

    params = tuple(dataclasses.replace(p, grad_sync=tuple(a for a in p.grad_sync if a != "dep"))
                   for p in plan.params)
    return dataclasses.replace(plan, params=params)


def _predict(cap, mode, shape, batch, seq, cluster, *, depth_sync: bool = True):
    """(fwd s, bwd s, notes) for one row; interpolates over the batch when it does not split."""
    from autoshard.cost import estimate
    from autoshard.passes.propagate import propagate

    pol = _policy(mode, shape)
    split = pol.mesh.size(tuple(a for a in pol.batch_axes if a != "dp")) if pol.batch_axes else 1

    def at(b):
        plan = propagate(cap, pol, batch_size=b, seq_len=seq)
        e = estimate(plan if depth_sync else _without_depth_sync(plan), cluster)
        f = e.flops_fwd / cluster_flops(cluster)
        return f + e.comm_s_fwd, 2 * f + e.comm_s_bwd, e

    if batch % split == 0:
        fwd, bwd, e = at(batch)
        return fwd, bwd, "", e
    b1 = max(split, batch // split * split)
    b2 = b1 + split
    f1, w1, e = at(b1)
    f2, w2, _ = at(b2)
    x = (batch - b1) / (b2 - b1)
    return f1 + x * (f2 - f1), w1 + x * (w2 - w1), f"batch {batch} % {split} ≠ 0: interpolated {b1}..{b2}", e


def cluster_flops(cluster) -> float:
    return cluster.flops


def simulate(table, *, seq: int, layers: int, vocab: int, cluster, caps: dict, log,
             depth_sync: bool = True) -> list[dict]:
    rows = []
    for method, mode, shape, batch, hidden, heads, pf, pb, pthr in table:
        key = (hidden, heads, seq)
        if key not in caps:
            t0 = time.perf_counter()
            caps[key] = _capture(hidden, heads, layers, vocab, seq)
            log(f"captured hidden {hidden}, {heads} heads in {time.perf_counter() - t0:.1f} s")
        fwd, bwd, note, e = _predict(caps[key], mode, shape, batch, seq, cluster, depth_sync=depth_sync)
        rows.append({"method": method, "mode": mode, "shape": list(shape), "gpus": _prod(shape), "batch": batch,
                     "hidden": hidden, "heads": heads, "paper_fwd_s": pf, "paper_bwd_s": pb,
                     "paper_throughput": pthr, "pred_fwd_s": fwd, "pred_bwd_s": bwd,
                     "pred_throughput": 1.0 / (fwd + bwd), "pred_comm_s": e.comm_s, "pred_compute_s": e.compute_s,
                     "pred_inter_node_MB": e.inter_node_bytes / 1e6, "note": note})
    return rows


def _prod(s):
    out = 1
    for x in s:
        out *= x
    return out


def compare(rows, pairs) -> list[dict]:
    by = {_key(r["method"], r["shape"]): r for r in rows}
    out = []
    for label, a, b in pairs:
        ra, rb = by[_key(a[0], list(a[1]))], by[_key(b[0], list(b[1]))]
        paper = ra["paper_throughput"] / rb["paper_throughput"]
        pred = ra["pred_throughput"] / rb["pred_throughput"]
        out.append({"ratio": label, "paper": paper, "predicted": pred, "rel_err": pred / paper - 1,
                    "within_30pct": abs(pred / paper - 1) <= TOLERANCE})
    return out


def order_at_64(rows) -> dict:
    r64 = [r for r in rows if r["gpus"] == 64]
    paper = [_key(r["method"], r["shape"]) for r in sorted(r64, key=lambda r: -r["paper_throughput"])]
    pred = [_key(r["method"], r["shape"]) for r in sorted(r64, key=lambda r: -r["pred_throughput"])]
    best = {}
    for r in r64:      # the best shape of each method (the three "columns": Megatron, Optimus, Tesseract)
        for k, name in (("paper_throughput", "paper"), ("pred_throughput", "pred")):
            cur = best.setdefault(name, {}).get(r["method"])
            if cur is None or r[k] > cur:
                best[name][r["method"]] = r[k]
    methods_paper = sorted(best["paper"], key=lambda m: -best["paper"][m])
    methods_pred = sorted(best["pred"], key=lambda m: -best["pred"][m])
    fwd_paper = [_key(r["method"], r["shape"]) for r in sorted(r64, key=lambda r: r["paper_fwd_s"])]
    fwd_pred = [_key(r["method"], r["shape"]) for r in sorted(r64, key=lambda r: r["pred_fwd_s"])]
    return {"rows_by_throughput_paper": paper, "rows_by_throughput_pred": pred, "rows_same": paper == pred,
            "methods_by_throughput_paper": methods_paper, "methods_by_throughput_pred": methods_pred,
            "methods_same": methods_paper == methods_pred,
            "rows_by_fwd_time_paper": fwd_paper, "rows_by_fwd_time_pred": fwd_pred, "fwd_same": fwd_paper == fwd_pred}


def _judge(cmp) -> tuple[int, int]:
    return sum(c["within_30pct"] for c in cmp), len(cmp)


def main(argv=None) -> int:
    from rich.table import Table

    from autoshard.cost import Cluster

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=1024, help="assumed sequence length (not given in the paper)")
    ap.add_argument("--layers", type=int, default=2, help="layers planned (ratios do not depend on it)")
    ap.add_argument("--vocab", type=int, default=128, help="vocabulary (small: the paper times layers only)")
    ap.add_argument("--cluster", default="tesseract-paper")
    ap.add_argument("--flops", type=float, default=None, help="override the cluster's sustained FLOP/s per rank")
    ap.add_argument("--sweep", type=int, nargs="*", default=[128, 512, 1024, 2048],
                    help="sequence lengths for the summary sweep")
    args = ap.parse_args(argv)
    con = _common.console(230)
    cluster = Cluster.preset(args.cluster)
    if args.flops:
        cluster = cluster.replace(flops=args.flops)
    con.print(f"[bold]cluster[/bold] {cluster.describe()}")
    con.print(f"assumed: seq_len {args.seq_len}, {args.layers} layers, vocab {args.vocab}, fp32; "
              "optimizer step not timed (the paper times forward and backward)")
    caps: dict = {}
    log = (lambda s: con.print(f"[dim]{s}[/dim]"))
    result = {"cluster": cluster.__dict__, "seq_len": args.seq_len, "layers": args.layers, "vocab": args.vocab,
              "tolerance": TOLERANCE}
    for name, table in (("table1", TABLE1), ("table2", TABLE2)):
        rows = simulate(table, seq=args.seq_len, layers=args.layers, vocab=args.vocab, cluster=cluster,
                        caps=caps, log=log)
        rows_nd = simulate(table, seq=args.seq_len, layers=args.layers, vocab=args.vocab, cluster=cluster,
                           caps=caps, log=log, depth_sync=False)
        cmp, cmp_nd = compare(rows, COMPARE[name]), compare(rows_nd, COMPARE[name])
        order, order_nd = order_at_64(rows), order_at_64(rows_nd)
        result[name] = {"rows": rows, "rows_paper_code": rows_nd, "ratios": cmp, "ratios_paper_code": cmp_nd,
                        "order_at_64": order, "order_at_64_paper_code": order_nd}
        t = Table(title=f"{name}: seconds per batch, paper vs predicted (autoshard plan; throughput = 1 / "
                        f"(fwd + bwd), as in the paper); seq_len {args.seq_len}", header_style="bold")
        for c in ("method", "shape", "batch", "hidden", "paper fwd", "pred fwd", "paper bwd", "pred bwd",
                  "paper it/s", "pred it/s", "pred it/s paper's code", "pred comm share", "note"):
            t.add_column(c, justify="left" if c in ("method", "shape", "note") else "right")
        for r, rn in zip(rows, rows_nd):
            step = r["pred_fwd_s"] + r["pred_bwd_s"]
            t.add_row(r["method"], str(r["shape"]), str(r["batch"]), str(r["hidden"]), f"{r['paper_fwd_s']:.4f}",
                      f"{r['pred_fwd_s']:.4f}", f"{r['paper_bwd_s']:.4f}", f"{r['pred_bwd_s']:.4f}",
                      f"{r['paper_throughput']:.3f}", f"{r['pred_throughput']:.3f}", f"{rn['pred_throughput']:.3f}",
                      f"{r['pred_comm_s'] / step:.0%}", r["note"])
        con.print(t)
        t = Table(title=f"{name}: throughput ratios, target ±{TOLERANCE:.0%} of the paper", header_style="bold")
        for c in ("ratio", "paper", "autoshard plan", "err", "±30%", "paper's code", "err ", "±30% "):
            t.add_column(c, justify="left" if c == "ratio" else "right")
        yes, no = "[green]yes[/green]", "[red]NO[/red]"
        for c, cn in zip(cmp, cmp_nd):
            t.add_row(c["ratio"], f"{c['paper']:.3f}", f"{c['predicted']:.3f}", f"{c['rel_err']:+.0%}",
                      yes if c["within_30pct"] else no, f"{cn['predicted']:.3f}", f"{cn['rel_err']:+.0%}",
                      yes if cn["within_30pct"] else no)
        con.print(t)
        for label, c, o in (("autoshard plan", cmp, order), ("paper's code", cmp_nd, order_nd)):
            k, n = _judge(c)
            con.print(f"{name} · {label}: {k}/{n} ratios within ±30%; at 64 GPUs the methods by throughput "
                      f"(best shape each): paper {' > '.join(o['methods_by_throughput_paper'])}, predicted "
                      f"{' > '.join(o['methods_by_throughput_pred'])} → "
                      + ("[green]order reproduced[/green]" if o["methods_same"] else "[red]order NOT reproduced[/red]"))
            con.print(f"    rows by throughput: paper {o['rows_by_throughput_paper']}, predicted "
                      f"{o['rows_by_throughput_pred']} → {'same' if o['rows_same'] else 'different'}")
    con.print("[yellow]* Table 2's \\[8,8,1] row repeats Table 1's numbers (0.1799 / 0.5178 / 1.4333) although its "
              "batch (384) and hidden (8192) differ: likely a copy slip in the paper. Note also that the paper's "
              "Optimus \\[q,q] and Tesseract \\[q,q,1] rows run the same algorithm yet differ by up to 43% (16 GPUs), "
              "so implementation differences alone exceed ±30% there; the cost model predicts them equal.[/yellow]",
              markup=True)

    sweep = {}
    fp32 = cluster.replace(flops=0.7 * 19.5e12, name=cluster.name + " (fp32, no TF32)")
    t = Table(title="sweep over what the paper does not state: sequence length and matmul rate "
                    "(cells: autoshard plan / paper's code without the depth all-reduce)", header_style="bold")
    for c in ("seq_len", "TFLOP/s", "T1 within ±30%", "T1 order at 64", "T2 within ±30%", "T2 order at 64"):
        t.add_column(c)
    for s_ in args.sweep:
        caps_s: dict = {}
        for cl in (cluster, fp32):
            cells = [str(s_), f"{cl.flops / 1e12:.1f}"]
            key = f"seq{s_}/{cl.flops / 1e12:.1f}TFLOPs"
            sweep[key] = {}
            for name, table in (("table1", TABLE1), ("table2", TABLE2)):
                res = []
                for ds in (True, False):
                    rows = simulate(table, seq=s_, layers=args.layers, vocab=args.vocab, cluster=cl, caps=caps_s,
                                    log=lambda _s: None, depth_sync=ds)
                    c, o = compare(rows, COMPARE[name]), order_at_64(rows)
                    res.append((_judge(c), o["methods_same"], c))
                sweep[key][name] = {"plan": {"within": res[0][0], "order": res[0][1], "ratios": res[0][2]},
                                    "paper_code": {"within": res[1][0], "order": res[1][1], "ratios": res[1][2]}}
                cells.append(" / ".join(f"{k}/{n}" for (k, n), _, _ in res))
                cells.append(" / ".join("yes" if ok else "no" for _, ok, _ in res))
            t.add_row(*cells)
    con.print(t)
    result["sweep"] = sweep
    path = _common.write_result("tesseract_sim", result)
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
