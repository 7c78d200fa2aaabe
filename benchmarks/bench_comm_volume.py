"""Communication volume per rank for one training step (forward + backward) of a
tiny Llama on gloo ranks: measured by the collectives ledger, vs the plan, vs the
formula of docs/design.md, "Communication and memory".

Runs: 1d on 2 / 4 / 8 ranks, 2d on 4, 2.5d on 8 (q = d = 2), 3d on 8 (if
registered). The formula covers the transformer layers (1d: 8(p−1)/p·N·h per
layer) or the Linears of the mode's kernel (2d / 2.5d / 3d, with the depth
all-reduce of their weight gradients); "plan, same nodes" is the plan's figure
for exactly those nodes, "ledger" and "plan" are whole-step totals.

    python benchmarks/bench_comm_volume.py
"""

from __future__ import annotations

import _common


def main() -> int:
    from rich.table import Table

    con = _common.console(220)
    cfg = _common.TINY_LLAMA
    res = _common.run_tiny_llama(con)
    t = Table(title="comm bytes per rank per step (rank 0; ring model: all-reduce 2(p−1)/p·B, gather / "
                    "reduce-scatter (p−1)/p·B)", header_style="bold")
    for c in ("mode", "ranks", "mesh", "ledger B", "plan B", "ledger = plan", "calls ledger/plan",
              "formula covers", "formula B", "plan B (same nodes)", "plan / formula", "ranks agree"):
        t.add_column(c, justify="left" if c in ("mode", "mesh", "formula covers", "ledger = plan") else "right")
    rows = []
    for r in res:
        r0 = r["ranks"][0]
        agree = len({round(x["ledger_bytes"]) for x in r["ranks"]}) == 1
        eq = abs(r0["ledger_bytes"] - r0["plan_bytes"]) <= 1e-9 * max(1.0, r0["plan_bytes"])
        ratio = r0["formula_plan_same_nodes"] / r0["formula_formula"] if r0["formula_formula"] else float("nan")
        t.add_row(r["mode"], str(r["world"]), r0["mesh"], f"{r0['ledger_bytes']:,.0f}", f"{r0['plan_bytes']:,.0f}",
                  "[green]yes[/green]" if eq else "[red]NO[/red]", f"{r0['ledger_calls']}/{r0['plan_calls']}",
                  r0["formula_covers"], f"{r0['formula_formula']:,.0f}", f"{r0['formula_plan_same_nodes']:,.0f}",
                  f"{ratio:.4f}", "yes" if agree else "no (max shown in JSON)")
        rows.append({"mode": r["mode"], "world": r["world"], "mesh": r0["mesh"], "ledger_bytes": r0["ledger_bytes"],
                     "plan_bytes": r0["plan_bytes"], "ledger_equals_plan": eq, "ledger_calls": r0["ledger_calls"],
                     "plan_calls": r0["plan_calls"], "formula_covers": r0["formula_covers"],
                     "formula_bytes": r0["formula_formula"], "plan_same_nodes_bytes": r0["formula_plan_same_nodes"],
                     "plan_over_formula": ratio, "ledger_by_kind_rank0": r0["ledger_by_kind"],
                     "ledger_bytes_per_rank": [x["ledger_bytes"] for x in r["ranks"]]})
    con.print(t)
    path = _common.write_result("comm_volume", {"model": cfg, "batch": 8, "seq": 16, "rows": rows})
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
