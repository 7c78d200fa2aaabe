"""Time of ``autoshard plan MODEL --world-size N --mode auto``: the whole search, as a user
runs it, in a fresh process. Each command runs twice: *cold* (an empty capture cache in a
temporary folder: the shallow export included) and *warm* (the capture read back); wall,
user and system seconds of the child (``os.wait4``), the rows the table shows and the
candidate chosen.

Targets (issue 56; cold, wall, this 2-core machine): llama:7b at 64 ranks <= 8 s,
llama:70b at 4096 ranks <= 30 s. The search prices every candidate on the stamped
capture's shallow graphs and plans only the chosen one whole (docs/design.md, "Pricing the
search"); ``--full`` times the old way too (``AUTOSHARD_SEARCH_PRICED=0``: every candidate
planned and traced on the full graph), which takes minutes.

    python benchmarks/bench_plan.py [--runs llama:7b:64 llama:70b:4096] [--full]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import _common

TARGETS_WALL_S = {("llama:7b", 64): 8.0, ("llama:70b", 4096): 30.0}


def _run(model: str, world: int, *, cache: str, priced: bool) -> dict:
    env = dict(os.environ, AUTOSHARD_CACHE=cache, AUTOSHARD_SEARCH_PRICED="1" if priced else "0",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "autoshard.cli", "plan", model, "--world-size", str(world), "--mode", "auto",
           "--width", "250"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    chosen = re.search(r"chosen: (.*?) \(mesh", out)
    rows = len(re.findall(r"^│\s+(?:\d+|-)\s+│", out, flags=re.M))
    return {"model": model, "world": world, "priced": priced, "wall_s": wall, "user_s": usage.ru_utime,
            "sys_s": usage.ru_stime, "rc": os.waitstatus_to_exitcode(status), "candidates": rows,
            "chosen": chosen.group(1) if chosen else None, "tail": out.splitlines()[-3:] if proc else []}


def main() -> int:
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", default=["llama:7b:64", "llama:70b:4096"], help="MODEL:WORLD ...")
    ap.add_argument("--full", action="store_true", help="also time every candidate planned on the full graph")
    args = ap.parse_args()
    con = _common.console(200)
    rows = []
    for spec in args.runs:
        model, world = spec.rsplit(":", 1)
        for priced in ((True, False) if args.full else (True,)):
            with tempfile.TemporaryDirectory() as cache:        # cold: nothing captured yet
                for phase in ("cold", "warm"):
                    r = _run(model, int(world), cache=cache, priced=priced)
                    r["phase"] = phase
                    r["target_wall_s"] = TARGETS_WALL_S.get((model, int(world))) if phase == "cold" and priced else None
                    rows.append(r)
    t = Table(title="autoshard plan MODEL --world-size N --mode auto (fresh process each)", header_style="bold")
    for c in ("model", "ranks", "search", "cache", "wall s", "user s", "sys s", "target", "table rows", "chosen"):
        t.add_column(c, justify="left" if c in ("model", "search", "cache", "chosen") else "right")
    for r in rows:
        tgt = r["target_wall_s"]
        ok = "" if tgt is None else (f"[green]≤ {tgt:g}[/green]" if r["wall_s"] <= tgt else f"[red]> {tgt:g}[/red]")
        t.add_row(r["model"], str(r["world"]), "priced" if r["priced"] else "full", r["phase"], f"{r['wall_s']:.1f}",
                  f"{r['user_s']:.1f}", f"{r['sys_s']:.1f}", ok, str(r["candidates"]),
                  r["chosen"] or f"[red]rc {r['rc']}[/red]")
    con.print(t)
    con.print(f"load average at the end: {os.getloadavg()[0]:.1f} (other jobs inflate wall, not user, time)")
    path = _common.write_result("plan", {"rows": rows, "loadavg": os.getloadavg()})
    con.print(f"wrote {path}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
