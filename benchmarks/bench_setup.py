"""Setup time: ``autoshard.shard()`` on 4 gloo ranks, first launch (nothing cached),
second launch (the on-disk caches warm, the graphs the processes loaded forgotten, as
in new processes) and the same processes sharding again, against one dense
``torch.export`` of the same model in one process and PyTorch's
``parallelize_module`` with a hand-written 1d plan, all in one run.

Rank 0 exports and the others load the captured graph (autoshard.launch.capture_share);
each rank stores what its shard() ended in (autoshard.launch.launch_cache), so the second
launch rebuilds its module from that entry: no capture, no planning, no rewrite
(``AUTOSHARD_LAUNCH_CACHE=off`` measures the capture cache alone).

    python benchmarks/bench_setup.py [--world 4] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import _common


def main(argv=None) -> int:
    from rich.table import Table

    import _workers
    from dist_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args(argv)
    cfg = dict(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
               num_attention_heads=8, num_key_value_heads=8, vocab_size=512, max_position_embeddings=256)
    con = _common.console(200)
    con.print(f"tiny Llama {cfg}; {args.world} gloo ranks, 1 thread each")

    import torch

    from autoshard.passes.capture import capture

    torch.set_num_threads(1)
    model = _workers._tiny_llama(cfg)
    inputs = _workers._batch(cfg["vocab_size"], args.batch, args.seq)
    t0 = time.perf_counter()
    capture(model, example_inputs=inputs)
    dense_export = time.perf_counter() - t0
    pool = get_pool(args.world, timeout=1800)
    with tempfile.TemporaryDirectory(prefix="autoshard-bench-cache-") as cache:
        per_rank = pool.run(_workers.setup_time, cfg, args.batch, args.seq, cache)
    slowest = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    row = {"dense_export_s": dense_export, "first_launch_s": slowest["first"], "warm_launch_s": slowest["warm"],
           "same_process_again_s": slowest["again"], "parallelize_module_s": slowest["parallelize_module"]}
    t = Table(title=f"setup on {args.world} ranks (slowest rank)", header_style="bold")
    for c in ("one dense torch.export", "shard() first launch", "shard() second launch (cache warm)",
              "shard() again, same process", "parallelize_module", "first / export", "warm / parallelize_module"):
        t.add_column(c, justify="right")
    t.add_row(f"{dense_export:.2f} s", f"{row['first_launch_s']:.2f} s", f"{row['warm_launch_s']:.2f} s",
              f"{row['same_process_again_s']:.2f} s", f"{row['parallelize_module_s']:.2f} s", f"{row['first_launch_s'] / dense_export:.2f}",
              f"{row['warm_launch_s'] / row['parallelize_module_s']:.2f}")
    con.print(t)
    path = _common.write_result("setup", {"model": cfg, "world": args.world, "batch": args.batch, "seq": args.seq,
                                          **row, "per_rank": per_rank})
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
