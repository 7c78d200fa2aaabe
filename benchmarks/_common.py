"""Shared helpers of the benchmarks: paths, result JSON, rich output, tiny models.

Benchmarks are scripts (``python benchmarks/bench_x.py``), not tests. Each prints a
rich table and writes ``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
for _p in (HERE, os.path.join(ROOT, "tests"), ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def console(width: int = 200):
    from rich.console import Console

    return Console(width=width, highlight=False)


def write_result(name: str, data: dict) -> str:
    """Write ``data`` (plus host facts) to ``benchmarks/results/<name>.json``; return the path."""
    import torch

    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    meta = {"benchmark": name, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
            "torch": torch.__version__, "cpus": os.cpu_count(), "host": platform.platform(),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])}
    with open(path, "w") as f:
        json.dump({"meta": meta, **data}, f, indent=1, default=str)
    return path


def human_bytes(n: float) -> str:
    from autoshard.planning.cost import human_bytes as hb

    return hb(n)


# Tiny Llama that every mode can split without replicating kv heads (8 heads,
# 8 kv heads, hidden 64): 1d up to 8 ranks, 2d/2.5d/3d with q = 2.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=128, max_position_embeddings=64)

def slowest_medians(per_rank: list[dict], key: str = "times") -> dict:
    """Per variant of ``per_rank[r][key]`` (name -> per-step seconds on rank ``r``): the
    median over steps of the slowest rank's time, a step's time being its slowest rank's."""
    return {k: statistics.median(max(r[key][k][i] for r in per_rank) for i in range(len(v)))
            for k, v in per_rank[0][key].items()}


def add_llama_args(ap, *, batch: int, hidden: int = 256, layers: int = 2) -> None:
    """``--hidden``, ``--layers``, ``--batch`` of the benchmarks' tiny Llama (see :func:`llama_config`)."""
    ap.add_argument("--hidden", type=int, default=hidden, help="hidden size (MLP 4x, 8 heads)")
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--batch", type=int, default=batch)


def llama_config(args) -> dict:
    """The tiny Llama config of :func:`add_llama_args`' arguments: 8 heads and 8 kv heads
    (every mode splits them), vocabulary 512, 256 positions."""
    return dict(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                num_attention_heads=8, num_key_value_heads=8, vocab_size=512, max_position_embeddings=256)


#: (mode, world, depth) runs that fit on this host's gloo ranks.
RUNS = [("1d", 2, None), ("1d", 4, None), ("1d", 8, None), ("2d", 4, None), ("2.5d", 8, 2), ("3d", 8, None)]


def runs() -> list[tuple[str, int, int | None]]:
    from autoshard.policies import POLICIES

    return [r for r in RUNS if r[0] in POLICIES]


def run_tiny_llama(con, *, b: int = 8, s: int = 16) -> list[dict]:
    """Run ``_workers.comm_and_memory`` for each run of :func:`runs` on gloo ranks (the tiny
    Llama, one forward + backward); returns, per run, every rank's result."""
    import _workers
    from dist_pool import get_pool

    con.print(f"tiny Llama {TINY_LLAMA}, batch {b} × seq {s}, fp32, gloo")
    out = []
    for mode, world, depth in runs():
        t0 = time.perf_counter()
        per_rank = get_pool(world, timeout=900).run(_workers.comm_and_memory, mode, depth, TINY_LLAMA, b, s)
        con.print(f"[dim]{mode} on {world} ranks: {time.perf_counter() - t0:.1f} s[/dim]")
        out.append({"mode": mode, "world": world, "depth": depth, "batch": b, "seq": s, "ranks": per_rank})
    return out
