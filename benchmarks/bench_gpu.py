"""Training-step time on CUDA + NCCL, one rank per GPU: dense eager (one GPU),
autoshard 1d, and PyTorch's ``parallelize_module`` 1d (ColwiseParallel q/k/v/gate/up,
RowwiseParallel o/down; per --arch, llama or bert), on the same model, batch and process group, timed
alternately step by step (forward + backward + AdamW, bf16 autocast or fp32),
with CUDA events. MFU = 6 · parameters · tokens / step time / peak, the peak
given by ``--peak-tflops`` (H100 SXM dense bf16: 989).

    torchrun --nproc-per-node N benchmarks/bench_gpu.py [--hidden 2048] [--layers 8] [--dtype bf16]

With one GPU the mesh has one rank: the numbers are autoshard's and DTensor's
overhead over the dense model (their collectives are size-1 NCCL calls).
Prints a table on rank 0 and writes benchmarks/results/gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


# per architecture: the model class, its config, the Linears PyTorch's hand-written 1d plan
# splits by column and by row (per layer), and the layer prefix
ARCHS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", "model.layers",
              ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
              ("self_attn.o_proj", "mlp.down_proj")),
    "bert": ("BertForMaskedLM", "BertConfig", "bert.encoder.layer",
             ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"),
             ("attention.output.dense", "output.dense")),
}


def _config(arch: str, args):
    import transformers

    h = args.hidden
    common = dict(hidden_size=h, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                  vocab_size=args.vocab, max_position_embeddings=max(2048, args.seq))
    if arch == "llama":
        return transformers.LlamaConfig(**common, intermediate_size=int(h * 8 / 3) // 64 * 64,
                                        num_key_value_heads=args.heads, use_cache=False)
    return transformers.BertConfig(**common, intermediate_size=4 * h, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0)


def _model(arch: str, cfg):
    import torch
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, ARCHS[arch][0])(cfg)


def _dtensor(arch: str, model, world: int, layers: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _, _, prefix, cols, rows = ARCHS[arch]
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("tp",))
    plan = {}
    for i in range(layers):
        plan.update({f"{prefix}.{i}.{n}": ColwiseParallel() for n in cols})
        plan.update({f"{prefix}.{i}.{n}": RowwiseParallel() for n in rows})
    return parallelize_module(model, mesh, plan)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gpu.json"))
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard.runtime.device import init_process_group

    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU here: skipped (run it under torchrun on a GPU machine)")
        return 0
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = _config(args.arch, args)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g, device="cpu")
    inputs = {"input_ids": ids.to(dev), "labels": ids.clone().to(dev)}
    dtype = torch.bfloat16 if args.dtype == "bf16" else None

    t0 = time.perf_counter()
    ours = autoshard.shard(_model(args.arch, cfg), mode="1d", example_inputs={k: v.cpu() for k, v in inputs.items()})
    shard_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = _dtensor(args.arch, _model(args.arch, cfg).to(dev), world, args.layers)
    dtensor_s = time.perf_counter() - t0
    runs = {"autoshard 1d": ours, "parallelize_module 1d": ref}
    if world == 1:
        runs["dense (eager)"] = _model(args.arch, cfg).to(dev)
    n_params = sum(p.numel() for p in _model(args.arch, cfg).parameters())
    # one AdamW kind for all: fused and foreach refuse the plain + DTensor mix of a partly parallelized model
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=False) for k, m in runs.items()}

    def one(m, opt):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = m(**inputs).loss
        loss.backward()
        opt.step()
        return loss

    times: dict = {k: [] for k in runs}
    losses: dict = {}
    for step in range(args.warmup + args.steps):
        for k, m in runs.items():
            dist.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            loss = one(m, opts[k])
            b.record()
            torch.cuda.synchronize()
            if step >= args.warmup:
                times[k].append(a.elapsed_time(b) / 1e3)
            loss = loss.detach()
            losses[k] = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
    tokens = args.batch * args.seq
    rows = []
    for k, ts in times.items():
        t = statistics.median(ts)
        mfu = 6 * n_params * tokens / t / (args.peak_tflops * 1e12 * world)
        rows.append({"run": k, "median_step_s": t, "tokens_per_s": tokens / t, "mfu": mfu, "loss": losses[k]})
    mem = torch.cuda.max_memory_allocated(dev) / 2 ** 30
    if rank == 0:
        print(f"{torch.cuda.get_device_name(dev)} × {world}; torch {torch.__version__}; {args.arch} hidden {args.hidden}, "
              f"{args.layers} layers, vocab {args.vocab}, {n_params / 1e6:.0f} M params; batch {args.batch} × "
              f"{args.seq}; {args.dtype}; median of {args.steps} steps; shard() {shard_s:.1f} s, "
              f"parallelize_module {dtensor_s:.1f} s; peak memory (all runs) {mem:.1f} GiB")
        base = times["parallelize_module 1d"]
        print(f"{'run':<24}{'step ms':>10}{'tokens/s':>12}{'MFU':>8}{'vs DTensor':>12}{'loss':>10}")
        for r in rows:
            ratio = r["median_step_s"] / statistics.median(base)
            print(f"{r['run']:<24}{r['median_step_s'] * 1e3:>10.1f}{r['tokens_per_s']:>12.0f}{r['mfu']:>8.3f}"
                  f"{ratio:>12.3f}{r['loss']:>10.4f}")
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "world": world, "torch": torch.__version__,
                       "arch": args.arch, "config": cfg.to_dict(), "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
                       "params": n_params, "shard_s": shard_s, "parallelize_module_s": dtensor_s, "rows": rows,
                       "times": times}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
