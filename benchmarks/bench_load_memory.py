"""Peak memory per rank of ``autoshard.from_pretrained`` vs loading the dense model.

A random Llama (~60M parameters, fp32, ~240 MB; vocab 32000, hidden 512, 8 layers)
is saved once with ``save_pretrained``. Then, each in *fresh* gloo CPU ranks
(``tests/dist_pool.RankPool``):

* ``baseline``: the same flow with no weights: the model built on meta, captured,
  planned and rewritten (``autoshard.shard`` of the meta model);
* ``from_pretrained``: ``autoshard.from_pretrained(path, mode="1d")``, each rank
  reading only its slices; then ``save_pretrained`` of the sharded module back to
  a dense folder (streamed: rank 0 holds one dense tensor at a time);
* ``naive``: ``AutoModelForCausalLM.from_pretrained`` (the whole model on every
  rank) followed by ``autoshard.shard``.

Per rank it records the peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs`` at the start of each phase, after ``gc`` and
``malloc_trim``), the RSS at the start and end, and wall time. The acceptance
bound (tested in ``tests/test_checkpoint.py::test_from_pretrained_peak_rss``):
peak(from_pretrained) < model bytes / tp × 1.3 + peak(baseline).

    python benchmarks/bench_load_memory.py [--world 2] [--keep DIR] [--skip-naive]

Prints a rich table and writes ``benchmarks/results/load_memory.json`` (via ``_common.write_result``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

LLAMA = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
             tie_word_embeddings=False)


# ------------------------------------------------------------------------------------ on each rank

def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


def _reset_peak() -> int:
    """Free what can be freed, reset the peak RSS to the current RSS; return it."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status()["VmRSS"]


def _inputs():
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 16), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _phase(fn):
    start = _reset_peak()
    t = time.perf_counter()
    value = fn()
    sec = time.perf_counter() - t
    st = _status()
    return value, {"rss_start": start, "peak_rss": st["VmHWM"], "rss_end": st["VmRSS"], "seconds": sec}


def rank_task(rank, world, kind, path, out_dir=None):
    import torch

    torch.set_num_threads(1)
    import transformers  # noqa: F401  (imported before the measured phase, as in every kind)

    import autoshard
    from autoshard.io.builder import build_meta, load_config

    inputs = _inputs()
    res = {"rank": rank}
    if kind == "baseline":
        def run():
            built = build_meta(load_config(path))
            built.model.eval()
            return autoshard.shard(built.model, mode="1d", example_inputs=inputs,
                                   weights=lambda gm, plan, rank: None)   # meta stays meta: nothing read
        sharded, m = _phase(run)
    elif kind == "from_pretrained":
        sharded, m = _phase(lambda: autoshard.from_pretrained(path, mode="1d", example_inputs=inputs,
                                                             progress=False))
        res["load_stats"] = sharded.load_stats
    elif kind == "naive":
        def run():
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            return autoshard.shard(model, mode="1d", example_inputs=inputs)
        sharded, m = _phase(run)
    else:
        raise ValueError(kind)
    res.update(m)
    res["local_param_bytes"] = sum(p.numel() * p.element_size() for p in sharded.parameters())
    if kind != "baseline":
        with torch.no_grad():
            res["loss"] = float(sharded(**inputs).loss)
    if kind == "from_pretrained" and out_dir:
        _, m2 = _phase(lambda: sharded.save_pretrained(out_dir))
        res["save_pretrained"] = m2
    return res


# ------------------------------------------------------------------------------------ driver

def make_model(path: str) -> dict:
    """Save the random Llama once (reused if ``path`` already holds it)."""
    import torch
    import transformers

    if not os.path.exists(os.path.join(path, "model.safetensors")) and \
            not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**LLAMA)
        model = transformers.LlamaForCausalLM(cfg)
        model.save_pretrained(path)
        del model
        gc.collect()
    cfg = transformers.AutoConfig.from_pretrained(path)
    from autoshard.io.builder import build_meta

    built = build_meta(cfg)
    n = sum(p.numel() for p in {id(p): p for p in built.model.parameters()}.values())
    return {"params": n, "model_bytes": n * 4, "config": LLAMA}


def measure(path: str, *, world: int = 2, modes=("from_pretrained", "naive"), save_dir: str | None = None,
            timeout: float = 900) -> dict:
    from dist_pool import RankPool

    from bench_load_memory import rank_task as task   # by module name, also when run as a script
    info = make_model(path)
    out = {**info, "world": world, "mode": "1d", "runs": {}}
    for kind in ("baseline", *modes):
        pool = RankPool(world, timeout=timeout)
        try:
            t = time.perf_counter()
            ranks = pool.run(task, kind, path, save_dir if kind == "from_pretrained" else None)
            out["runs"][kind] = {"ranks": ranks, "wall_seconds": time.perf_counter() - t}
        finally:
            pool.close()
    out["limit_bytes_over_baseline"] = info["model_bytes"] / world * 1.3
    return out


def table(res: dict):
    from rich.table import Table

    mb = 1 << 20
    t = Table(title=f"peak RSS per rank · random Llama {res['params'] / 1e6:.1f}M params fp32 "
                    f"({res['model_bytes'] / mb:.0f} MiB) · 1d over {res['world']} ranks", header_style="bold")
    for c in ("run", "rank", "RSS at start MiB", "peak RSS MiB", "peak − baseline peak MiB", "bound MiB",
              "RSS at end MiB", "local params MiB", "read MiB", "seconds"):
        t.add_column(c, justify="right" if c not in ("run",) else "left")
    base = {r["rank"]: r["peak_rss"] for r in res["runs"]["baseline"]["ranks"]}
    lim = res["limit_bytes_over_baseline"]
    for kind, run in res["runs"].items():
        for r in run["ranks"]:
            over = r["peak_rss"] - base[r["rank"]]
            read = r.get("load_stats", {}).get("bytes_read")
            t.add_row(kind, str(r["rank"]), f"{r['rss_start'] / mb:.0f}", f"{r['peak_rss'] / mb:.0f}",
                      "-" if kind == "baseline" else f"{over / mb:.0f}",
                      "-" if kind == "baseline" else f"{lim / mb:.0f}", f"{r['rss_end'] / mb:.0f}",
                      "- (meta)" if kind == "baseline" else f"{r['local_param_bytes'] / mb:.0f}",
                      "-" if read is None else f"{read / mb:.0f}",
                      f"{r['seconds']:.1f}")
            if "save_pretrained" in r:
                s = r["save_pretrained"]
                t.add_row("  save_pretrained", str(r["rank"]), f"{s['rss_start'] / mb:.0f}",
                          f"{s['peak_rss'] / mb:.0f}", f"+{(s['peak_rss'] - s['rss_start']) / mb:.0f} over start",
                          "-", f"{s['rss_end'] / mb:.0f}", "-", "-", f"{s['seconds']:.1f}")
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--keep", help="folder for the saved model (reused between runs)")
    ap.add_argument("--skip-naive", action="store_true")
    args = ap.parse_args(argv)
    from _common import console, write_result

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or os.path.join(tmp, "llama60m")
        os.makedirs(path, exist_ok=True)
        modes = ("from_pretrained",) if args.skip_naive else ("from_pretrained", "naive")
        res = measure(path, world=args.world, modes=modes, save_dir=os.path.join(tmp, "resaved"))
    con = console()
    con.print(table(res))
    base = {r["rank"]: r["peak_rss"] for r in res["runs"]["baseline"]["ranks"]}
    ok = all(r["peak_rss"] < base[r["rank"]] + res["limit_bytes_over_baseline"]
             for r in res["runs"]["from_pretrained"]["ranks"])
    res["from_pretrained_within_bound"] = ok
    losses = {k: sorted({r["loss"] for r in v["ranks"]}) for k, v in res["runs"].items() if k != "baseline"}
    res["losses"] = losses
    out = write_result("load_memory", res)
    con.print(f"bound peak < baseline peak + model/tp × 1.3: {'[green]met' if ok else '[red]NOT met'}; "
              f"loss per run {losses}; wrote {os.path.relpath(out, ROOT)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
