"""Memory per rank for one training step of a tiny Llama on gloo ranks, per mode:
parameter and gradient bytes (measured on the sharded module vs the plan) and the
peak activation bytes (tensors saved for backward at the end of the forward,
parameters excluded, measured with ``torch.autograd.graph.saved_tensors_hooks``)
vs the cost model's prediction (:mod:`autoshard.planning.activations`: the plan's forward
traced on meta, CPU attention rule), which must agree within ±5% (issue 7).

    python benchmarks/bench_memory.py
"""

from __future__ import annotations

import _common

TOLERANCE = 0.05


def main() -> int:
    from rich.table import Table

    con = _common.console(220)
    cfg = _common.TINY_LLAMA
    res = _common.run_tiny_llama(con)
    hb = _common.human_bytes
    t = Table(title="bytes per rank (max over ranks)", header_style="bold")
    for c in ("mode", "ranks", "mesh", "params", "plan params", "params = plan", "grads", "grads = plan",
              "saved activations", "predicted", "predicted / measured", "±5%"):
        t.add_column(c, justify="left" if c in ("mode", "mesh") else "right")
    rows = []
    ok = True
    for r in res:
        rk = r["ranks"]
        p, pp = max(x["param_bytes"] for x in rk), max(x["plan_param_bytes"] for x in rk)
        g = max(x["grad_bytes"] for x in rk)
        peq = all(x["param_bytes"] == x["plan_param_bytes"] for x in rk)
        geq = all(x["grad_bytes"] == x["est_grad_bytes"] for x in rk)
        a, ae = max(x["saved_activation_bytes"] for x in rk), max(x["est_activation_bytes"] for x in rk)
        within = all(abs(x["est_activation_bytes"] / x["saved_activation_bytes"] - 1) <= TOLERANCE for x in rk)
        ok &= within and peq and geq
        t.add_row(r["mode"], str(r["world"]), rk[0]["mesh"], hb(p), hb(pp), "[green]yes[/green]" if peq else "[red]NO[/red]",
                  hb(g), "[green]yes[/green]" if geq else "[red]NO[/red]", hb(a), hb(ae), f"{ae / a:.3f}",
                  "[green]pass[/green]" if within else "[red]FAIL[/red]")
        rows.append({"mode": r["mode"], "world": r["world"], "mesh": rk[0]["mesh"],
                     "param_bytes": [x["param_bytes"] for x in rk], "plan_param_bytes": [x["plan_param_bytes"] for x in rk],
                     "grad_bytes": [x["grad_bytes"] for x in rk], "params_equal_plan": peq, "grads_equal_plan": geq,
                     "saved_activation_bytes": [x["saved_activation_bytes"] for x in rk],
                     "est_activation_bytes": [x["est_activation_bytes"] for x in rk],
                     "activations_within_5pct": within})
    con.print(t)
    path = _common.write_result("memory", {"model": cfg, "batch": 8, "seq": 16, "tolerance": TOLERANCE,
                                           "pass": ok, "rows": rows})
    con.print(f"wrote {path}")
    con.print("[green]all rows pass[/green]" if ok else "[red]some rows fail[/red]")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
