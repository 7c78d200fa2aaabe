"""Cold ``torch.compile`` of a sharded module against a cold compile of the dense model.

Three paths, each in fresh processes with an inductor cache of its own (so every one
starts cold; the ranks of one path share it, as ranks on one host share the default):

- ``dense``: ``torch.compile(model)`` of the dense model on one rank;
- ``sharded.compile()``: autoshard's own method (each captured graph compiled, the
  input checks and padding eager; where a host runs more ranks than it has cores, its
  lowest rank compiles and the others load the result from inductor's cache, counted
  in the cache column; ``--each`` adds the run where every rank compiles at once);
- ``torch.compile(sharded)``: what users write. ``ShardedModule.forward`` keeps its
  checks, graph lookup and padding outside the compiled region by design (dynamo
  skips those frames), so the graph module is the one frame dynamo compiles.

Each sharded module first runs one eager step (capture, launch and the first call's
self-check are not compile time), then two compiled steps (forward + backward) are
timed; the cold figure is the first (it compiles), the ratio its quotient by the
dense one. Dynamo's unique graphs, graph breaks and recompiles are counted per path
(rank 0's).

    python benchmarks/bench_compile.py                              # tiny GPT-2, 1d@2 and 2d@4, inductor
    python benchmarks/bench_compile.py --runs 2d:4 --backend aot_eager
"""

from __future__ import annotations

import argparse
import os
import tempfile

import _common


def _run(world: int, fn, *args):
    from dist_pool import RankPool

    pool = RankPool(world, timeout=3600)
    try:
        return pool.run(fn, *args)
    finally:
        pool.close()


def main(argv=None) -> int:
    from rich.table import Table

    import _workers

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", help="a tiny model of tests/models.py (default: gpt2)")
    ap.add_argument("--runs", nargs="*", default=["1d:2", "2d:4"], help="MODE:RANKS of the sharded runs")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager)")
    ap.add_argument("--each", action="store_true",
                    help="also time sharded.compile(once_per_host=False): every rank compiles at once (the "
                         "default compiles once per host where the host's ranks outnumber its cores)")
    args = ap.parse_args(argv)
    con = _common.console(200)
    con.print(f"tiny {args.model} (tests/models.py); backend {args.backend}; every path cold in fresh processes; "
              f"1 thread per rank; step = forward + backward")
    root = tempfile.mkdtemp(prefix="autoshard-bench-compile-")
    rows = []

    def one(label, world, mode, path):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, label.replace(" ", "_").replace("@", "-"))
        per_rank = _run(world, _workers.compile_cold, args.model, mode, path, args.backend)
        r = per_rank[0]
        rows.append({"path": label, "world": world, "mode": mode, "first_s": r["times"][0], "second_s": r["times"][1],
                     "graphs": r["graphs"], "breaks": r["breaks"], "break_reasons": r["break_reasons"],
                     "recompiles": r["recompiles"], "cache_hits": sum(x["cache_hits"] for x in per_rank),
                     "cache_misses": sum(x["cache_misses"] for x in per_rank)})
        con.print(f"[dim]{label}: first step {r['times'][0]:.1f} s, second {r['times'][1] * 1e3:.0f} ms, "
                  f"{r['graphs']} graph(s), {r['breaks']} break(s)[/dim]")

    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        one("dense", 1, None, "dense")
        for spec in args.runs:
            mode, world = spec.split(":")
            one(f"sharded.compile() {mode}@{world}", int(world), mode, "method")
            if args.each:
                one(f"sharded.compile(once_per_host=False) {mode}@{world}", int(world), mode, "method-each")
            one(f"torch.compile(sharded) {mode}@{world}", int(world), mode, "module")
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
    dense = rows[0]["first_s"]
    for r in rows:
        r["ratio_to_dense"] = r["first_s"] / dense
    t = Table(title=f"Cold compile, {args.backend}: first compiled step against the dense model's", header_style="bold")
    for c in ("path", "cold first step s", "ratio to dense", "second step ms", "graphs", "breaks", "recompiles",
              "cache hits / misses (all ranks)"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["path"], f"{r['first_s']:.1f}", f"{r['ratio_to_dense']:.2f}×", f"{r['second_s'] * 1e3:.0f}",
                  str(r["graphs"]), str(r["breaks"]), str(r["recompiles"]), f"{r['cache_hits']} / {r['cache_misses']}")
    con.print(t)
    path = _common.write_result("compile", {"model": args.model, "backend": args.backend, "rows": rows})
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
