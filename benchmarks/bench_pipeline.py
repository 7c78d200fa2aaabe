"""Pipeline parallelism on gloo: per schedule (GPipe, 1F1B, interleaved 1F1B, ZBV), the
training-step time and the measured bubble (each rank's idle share of the step: the step
less the time inside its stages' forward and backward chunks and the optimizer, over the
step; the mean over ranks) against (p − 1)/(v·m + p − 1) and the cost model's prediction
(:func:`autoshard.planning.pipeline_cost.estimate_pipeline`), at 2 and 4 stages (tp 1: one
rank per pipeline rank) on a Llama of 8 layers.

    python benchmarks/bench_pipeline.py [--pp 2 4] [--micro 8] [--steps 8] [--hidden 256]

On a host with fewer cores than ranks the ranks share them: a rank waiting in a receive
leaves its core to another, so the measured idle share is a lower bound of what dedicated
devices would show, and the step times are not device times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common


def _worker(rank: int, world: int, cfg_kw: dict, schedule: str, m: int, b: int, s: int, steps: int,
            warmup: int) -> dict:
    import torch
    import torch.distributed as dist
    import transformers

    import autoshard
    from autoshard.training.train import train_step

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg_kw)).train()
    g = torch.Generator().manual_seed(1)
    mbs = []
    for _ in range(m):
        ids = torch.randint(0, cfg_kw["vocab_size"], (b, s), generator=g)
        mbs.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    sharded = autoshard.shard(model, mode="1d", pp=world, schedule=schedule, example_inputs=mbs[0])
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
    busy = [0.0]

    def timed(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                busy[0] += time.perf_counter() - t0
        return run
    train_step(sharded, mbs, opt)       # builds the stages and the schedule
    sched = next(iter(sharded.schedule_cache.values()))
    for st in getattr(sched, "_stages", None) or [sched._stage]:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            if hasattr(st, name):
                setattr(st, name, timed(getattr(st, name)))
    opt.step = timed(opt.step)
    times, idle = [], []
    for i in range(warmup + steps):
        dist.barrier()
        busy[0] = 0.0
        t0 = time.perf_counter()
        train_step(sharded, mbs, opt)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            idle.append(max(0.0, 1.0 - busy[0] / dt))
    est = sharded.estimate(m)
    return {"times": times, "idle": idle, "pred_step": est.step_s, "pred_bubble": est.bubble,
            "p2p_bytes": est.p2p_bytes, "stages": sharded.stage_indices}


def main(argv=None) -> int:
    from rich.table import Table

    import bench_pipeline
    from dist_pool import get_pool

    from autoshard.pipeline_parallel import SCHEDULES, bubble

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--schedules", nargs="*", default=list(SCHEDULES))
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    _common.add_llama_args(ap, batch=2, hidden=256, layers=8)     # --batch: rows per micro-batch
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    cfg = _common.llama_config(args)
    con = _common.console(200)
    con.print(f"Llama {cfg}; {args.micro} micro-batches of {args.batch} × {args.seq}; fp32; {args.steps} timed steps "
              f"after {args.warmup}; tp 1, one rank per pipeline rank, 1 thread each")
    table = Table(title="pipeline schedules: step time and bubble")
    for col in ("pp", "schedule", "stages/rank", "step ms (median, slowest rank)", "bubble measured",
                "(p−1)/(v·m+p−1)", "bubble predicted", "step ms predicted", "p2p bytes/rank/step"):
        table.add_column(col, justify="right")
    rows = []
    for pp in args.pp:
        pool = get_pool(pp, timeout=1800)
        for schedule in args.schedules:
            res = pool.run(bench_pipeline._worker, cfg, schedule, args.micro, args.batch, args.seq, args.steps,
                           args.warmup)
            step = statistics.median(max(r["times"][i] for r in res) for i in range(args.steps))
            measured = statistics.mean(statistics.median(r["idle"]) for r in res)
            v = SCHEDULES[schedule][1]
            ideal = bubble(schedule, pp, args.micro)
            row = dict(pp=pp, schedule=schedule, stages_per_rank=v, step_s=step, bubble_measured=measured,
                       bubble_formula=ideal, bubble_predicted=res[0]["pred_bubble"], step_predicted_s=res[0]["pred_step"],
                       p2p_bytes=res[0]["p2p_bytes"], per_rank_idle=[statistics.median(r["idle"]) for r in res])
            rows.append(row)
            table.add_row(str(pp), schedule, str(v), f"{step * 1e3:.1f}", f"{measured:.1%}", f"{ideal:.1%}",
                          f"{row['bubble_predicted']:.1%}", f"{row['step_predicted_s'] * 1e3:.1f}",
                          _common.human_bytes(row["p2p_bytes"]))
    con.print(table)
    path = _common.write_result("bench_pipeline", {"config": cfg, "args": vars(args), "rows": rows})
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
