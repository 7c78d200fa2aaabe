"""Expert-TP against expert parallelism on a tiny mixture of experts.

A Mixtral-style model (8 experts, top-2) trained with AdamW on the host's gloo ranks,
each layout at the same world size and data-parallel degree:

* **expert-TP** (``ep=1``): every rank holds every expert, each split over ``tp``;
  the rows stay on their rank.
* **EP** (``ep=dp``): a rank holds ``8 / ep`` experts (split over ``tp`` as well); the
  routed rows travel to their experts' ranks and back by all-to-all
  (docs/design.md, "Expert parallelism").

Per layout: tokens/s (global batch tokens per step time: median over steps of the
slowest rank), the bytes each rank sends per step (the ledger; all-to-all bytes apart)
against the plan's uniform-routing prediction, parameter and expert bytes per rank, and
the loss of the first step (the same for every layout: both are exact).

    python benchmarks/bench_moe.py                      # 4 ranks: tp2 × dp2 and tp1 × dp4
    python benchmarks/bench_moe.py --world 4 8 --steps 5
"""

from __future__ import annotations

import argparse
import statistics

import _common

MOE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4, vocab_size=256, max_position_embeddings=128, num_local_experts=8,
           num_experts_per_tok=2)


def moe_step(rank: int, world: int, cfg_kw: dict, dp: int, ep: int, b: int, s: int, steps: int, warmup: int) -> dict:
    """On every rank: Mixtral ``cfg_kw`` sharded in 1d over ``dp`` replicas with ``ep``,
    ``steps`` timed AdamW steps on this replica's ``b`` rows of ``s`` tokens."""
    import time

    import torch
    import transformers

    import autoshard
    from autoshard.runtime.collectives import CommLedger

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**cfg_kw))
    g = torch.Generator().manual_seed(1 + rank // (world // dp))
    ids = torch.randint(0, cfg_kw["vocab_size"], (b, s), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    sharded = autoshard.shard(model, mode="1d", dp=dp, example_inputs=batch, **({"ep": ep} if ep > 1 else {}))
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
    times, losses, ledger = [], [], None
    for i in range(warmup + steps):
        with CommLedger() as led:
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = sharded(**batch).loss
            loss.backward()
            opt.step()
            dt = time.perf_counter() - t0
        losses.append(loss.item())
        if i >= warmup:
            times.append(dt)
            ledger = led
    a2a = [c for c in ledger.calls if c.kind == "all_to_all"]
    plan = sharded.plan
    return {"times": times, "loss0": losses[0],
            "bytes": ledger.bytes_per_rank(), "a2a_bytes": sum(c.bytes_per_rank for c in a2a), "a2a_calls": len(a2a),
            "calls": ledger.count(), "plan_bytes": plan.comm_bytes_per_rank(),
            "plan_a2a_bytes": sum(c.bytes_per_rank for c in plan.comms() if c.kind == "all_to_all"),
            "param_bytes": sum(p.numel() * p.element_size() for p in sharded.parameters()),
            "expert_bytes": sum(p.numel() * p.element_size() for n, p in sharded.named_parameters() if ".experts." in n)}


def main(argv=None) -> int:
    from rich.table import Table

    import bench_moe
    from dist_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="*", default=[4])
    ap.add_argument("--batch", type=int, default=4, help="rows per replica")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    con = _common.console(180)
    rows = []
    for world in args.world:
        for dp in sorted({2, world} - {1}):
            for ep in (1, dp):
                per_rank = get_pool(world, timeout=1800).run(bench_moe.moe_step, MOE, dp, ep, args.batch, args.seq,
                                                             args.steps, args.warmup)
                step = statistics.median(max(r["times"][i] for r in per_rank) for i in range(args.steps))
                r0 = per_rank[0]
                rows.append({"world": world, "tp": world // dp, "dp": dp, "ep": ep,
                             "layout": "expert-TP" if ep == 1 else f"EP{ep}", "step_s": step,
                             "tokens_per_s": args.batch * dp * args.seq / step, "loss0": r0["loss0"],
                             "comm_bytes_per_rank": max(r["bytes"] for r in per_rank),
                             "a2a_bytes_per_rank": max(r["a2a_bytes"] for r in per_rank),
                             "plan_a2a_bytes_per_rank": r0["plan_a2a_bytes"],
                             "plan_comm_bytes_per_rank": r0["plan_bytes"], "calls": r0["calls"],
                             "param_bytes_per_rank": r0["param_bytes"], "expert_bytes_per_rank": r0["expert_bytes"]})
    t = Table(title=f"Mixtral (8 experts, top-2, hidden {MOE['hidden_size']}), 1d training step, "
                    f"{args.batch} × {args.seq} tokens per replica (slowest rank, median)", header_style="bold")
    for c in ("ranks", "tp × dp", "layout", "tokens/s", "step ms", "comm B/rank", "all-to-all B/rank (plan)",
              "param B/rank", "expert B/rank", "loss (step 1)"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["world"]), f"{r['tp']} × {r['dp']}", r["layout"], f"{r['tokens_per_s']:,.0f}",
                  f"{r['step_s'] * 1e3:.0f}", f"{r['comm_bytes_per_rank']:,.0f}",
                  f"{r['a2a_bytes_per_rank']:,.0f} ({r['plan_a2a_bytes_per_rank']:,.0f})",
                  f"{r['param_bytes_per_rank']:,}", f"{r['expert_bytes_per_rank']:,}", f"{r['loss0']:.5f}")
    con.print(t)
    path = _common.write_result("moe", {"config": MOE, "batch_per_replica": args.batch, "seq": args.seq,
                                        "steps": args.steps, "rows": rows})
    con.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
