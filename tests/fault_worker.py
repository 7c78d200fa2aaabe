"""One rank of a small training job, launched the way torchrun launches it (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment), for tests/test_faults.py.

    python tests/fault_worker.py CKPT_ROOT --steps 6 --save-every 2 [--stall-at 5] [--resume]

Trains a tiny Llama with autoshard 1d on a fixed batch; after every ``--save-every``
steps saves ``CKPT_ROOT/step_000K`` (autoshard.training.train.save_state). ``--stall-at S``:
rank 1 stops in the middle of step S (after its forward, before backward), writes
``CKPT_ROOT/stalled`` and sleeps, for the test to kill it. ``--resume`` continues
from the last complete checkpoint under CKPT_ROOT. Prints one JSON line per step:
``{"step": s, "loss": x}``; exits 3 with ``FAULT: ...`` on stderr when a collective
fails (another rank died or stalled past AUTOSHARD_TIMEOUT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

import torch  # noqa: E402

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)


def batch(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 128, (4, 8), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(4, 8, dtype=torch.long), "labels": ids.clone()}


def model():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).train()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--stall-at", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    import autoshard
    from autoshard.training import train as T
    from autoshard.ir.errors import CollectiveError

    root = Path(args.root)
    lr = 1e-3
    if args.resume:
        last = T.last_complete_state(root)
        sharded, opt, sched, start = T.load_state(last, model(), mode="1d", example_inputs=batch(0), lr=lr,
                                                  steps=args.steps)
        print(json.dumps({"resumed_from": str(last), "step": start}), flush=True)
    else:
        sharded = autoshard.shard(model(), mode="1d", example_inputs=batch(0))
        opt, sched = T.make_optimizer(sharded, lr=lr, steps=args.steps)
        start = 0
    rank = sharded.rank
    try:
        for step in range(start + 1, args.steps + 1):
            if args.stall_at == step:
                opt.zero_grad(set_to_none=True)
                loss = sharded(**batch(step)).loss
                if rank == 0:       # the weights of step - 1: a resumed run must reproduce it
                    (root / f"fwd{step}.json").write_text(json.dumps({"loss": loss.item()}))
                if rank == 1:
                    (root / "stalled").write_text(str(os.getpid()))
                    time.sleep(3600)
                with T.collectives_guard(f"step {step}"):
                    loss.backward()
            else:
                with T.collectives_guard(f"step {step}"):
                    loss, _ = T.train_step(sharded, [batch(step)], opt, sched)
                print(json.dumps({"step": step, "loss": loss}), flush=True)
            if step % args.save_every == 0:
                with T.collectives_guard(f"saving step {step}"):
                    T.save_state(sharded, root / f"step_{step:04d}", opt, step=step)
    except CollectiveError as e:
        print(f"FAULT: {e}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
