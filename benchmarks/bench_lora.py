"""Full fine-tune vs LoRA on a sharded Llama, per rank: trainable and frozen bytes, the
gradient and AdamW-state bytes measured on the ranks (and the plan's), and the median
step time (forward + backward + AdamW), at 1d on 2 ranks and 2d on 4 ranks.

    python benchmarks/bench_lora.py [--hidden 256] [--layers 2] [--rank 8] [--steps 6]

Writes benchmarks/results/bench_lora.json.
"""

from __future__ import annotations

import argparse
import statistics

import _common

RUNS = [("1d", 2), ("2d", 4)]


def _worker(rank: int, world: int, mode: str, cfg: dict, lora_r: int, b: int, s: int, steps: int) -> dict:
    import copy
    import time

    import torch
    import transformers

    import autoshard

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (b, s), generator=g)
    inputs = {"input_ids": ids, "labels": ids.clone()}
    out = {}
    for label in ("full", "lora"):
        model = copy.deepcopy(base)
        if label == "lora":
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(r=lora_r, lora_alpha=2 * lora_r,
                                                               target_modules="all-linear", task_type="CAUSAL_LM"))
        sharded = autoshard.shard(model, mode=mode, example_inputs=inputs)
        opt = torch.optim.AdamW([p for p in sharded.parameters() if p.requires_grad], lr=1e-4)
        times = []
        for _ in range(steps + 1):          # the first step is warm-up
            t0 = time.perf_counter()
            opt.zero_grad()
            sharded(**inputs).loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        params = list(sharded.parameters())
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)     # noqa: E731
        out[label] = {
            "trainable": nbytes(p for p in params if p.requires_grad),
            "frozen": nbytes(p for p in params if not p.requires_grad),
            "grads": nbytes(p.grad for p in params if p.grad is not None),
            "adam": nbytes(t for st in opt.state.values() for t in st.values()
                           if isinstance(t, torch.Tensor) and t.dim() > 0),
            "plan_trainable": sharded.plan.trainable_bytes_per_rank,
            "plan_frozen": sharded.plan.frozen_bytes_per_rank,
            "step_s": statistics.median(times[1:]),
        }
    return out


def main() -> int:
    from rich.table import Table

    from dist_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_llama_args(ap, batch=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    ap.add_argument("--steps", type=int, default=6, help="timed steps (after one warm-up step)")
    args = ap.parse_args()
    cfg = _common.llama_config(args)
    con = _common.console()
    hb = _common.human_bytes
    t = Table(title=f"full fine-tune vs LoRA r={args.rank} · Llama hidden {args.hidden}, {args.layers} layers · "
                    f"batch {args.batch} × {args.seq} · bytes per rank (max over ranks)", header_style="bold")
    for c in ("mode", "ranks", "run", "trainable", "frozen", "grads", "AdamW state", "AdamW / trainable",
              "= plan", "step (median)"):
        t.add_column(c, justify="left" if c in ("mode", "run") else "right")
    rows = []
    ok = True
    for mode, world in RUNS:
        per_rank = get_pool(world, timeout=1800).run(_worker, mode, cfg, args.rank, args.batch, args.seq, args.steps)
        for label in ("full", "lora"):
            rk = [r[label] for r in per_rank]
            row = {k: max(x[k] for x in rk) for k in ("trainable", "frozen", "grads", "adam")}
            row["step_s"] = max(x["step_s"] for x in rk)
            row["matches_plan"] = all(x["trainable"] == x["plan_trainable"] and x["frozen"] == x["plan_frozen"]
                                      for x in rk)
            ratio = row["adam"] / max(1, row["trainable"])
            ok &= row["matches_plan"] and abs(ratio - 2) <= 0.04
            rows.append({"mode": mode, "world": world, "run": label, **row, "adam_over_trainable": ratio})
            t.add_row(mode, str(world), label, hb(row["trainable"]), hb(row["frozen"]), hb(row["grads"]),
                      hb(row["adam"]), f"{ratio:.3f}", "yes" if row["matches_plan"] else "[red]NO[/red]",
                      f"{1000 * row['step_s']:.1f} ms")
    con.print(t)
    path = _common.write_result("bench_lora", {"config": cfg, "lora_rank": args.rank, "batch": args.batch,
                                               "seq": args.seq, "rows": rows, "ok": ok})
    con.print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
