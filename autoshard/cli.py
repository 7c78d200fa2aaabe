"""``autoshard`` command line: plan a model on a mesh, or check it can be sharded.

No processes and no weights: the model is built on the meta device from a local
Hugging Face folder, a ``config.json``, or a known architecture name
(``llama:7b``, ``gpt2:small``, ...; see ``autoshard plan --help``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

__all__ = ["main", "cmd_verify", "KNOWN_MODELS", "resolve_model", "build_parser", "human_bytes", "group_notes", "MODE_NAMES", "CLUSTER_NAMES"]

# Named here so `autoshard --help` needs no torch (policies and the cost model import it);
# tests/test_cli.py checks them against POLICIES and CLUSTERS.
MODE_NAMES = ("auto", "1d", "1d-sp", "2d", "2.5d", "3d")
CLUSTER_NAMES = ("dgx-a100", "h100-sxm", "cpu-gloo", "tesseract-paper")


from .known import DEFAULT_SIZES, KNOWN_MODELS, resolve_model  # noqa: E402,F401 - the CLI's names too


def human_bytes(n: float) -> str:
    """:func:`autoshard.planning.cost.human_bytes`, imported on first use."""
    from .planning.cost import human_bytes as hb

    return hb(n)

_EPILOG_PLAN = """\
MODEL_OR_CONFIG is one of
  a local Hugging Face folder (with config.json), e.g. ./my-model
  a config.json file,                            e.g. ./config.json
  a known architecture:size,                     one of {known}

examples:
  autoshard plan llama:7b --world-size 64 --mode 2.5d --depth 4 --batch-size 64 --seq-len 2048
  autoshard plan llama:7b --world-size 64 --mode auto --cluster dgx-a100 --batch-size 64 --seq-len 2048
  autoshard plan ./config.json --world-size 4 --mode 2d --batch-size 4 --seq-len 16 --json plan.json
  autoshard plan gpt2:small --world-size 8 --mode 1d --all-nodes
  autoshard plan llama:7b --world-size 8 --mode 1d --batch-size 8 --seq-len 2048 --step decode --no-table

Numbers are per rank and per training step (forward + backward). The predicted
time is the cost model's (see autoshard/planning/cost.py): compute = 3 x forward FLOPs /
cluster FLOP/s, plus every collective's latency + bytes / bandwidth on its link.
--batch-size is the global batch: dp replicas split it, the mode's batch axes split it further.
"""

_EPILOG_CHECK = """\
Reports, without processes or weights, whether MODEL_OR_CONFIG can be sharded
on this mesh, and lists the problems: planning errors (unsupported op, bad
world size / depth, heads not divisible, dropout in train mode, ...), fallback
nodes (ops gathered to a replicated layout), a batch that does not split over
the batch axes, and (with --cluster) a plan that does not fit in memory.

exit status: 0 no problems, 1 problems found, 2 bad arguments.

examples:
  autoshard check llama:7b --world-size 8 --mode 1d
  autoshard check ./config.json --world-size 8 --mode 2.5d --depth 2 --batch-size 8
"""


class _Help(argparse.RawDescriptionHelpFormatter):
    """Adds "(default: X)" to an option's help unless the help already names its default."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default" in h.lower() or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return h
        return h + " (default: %(default)s)"


def _add_common(p: argparse.ArgumentParser, *, mode_default: str | None) -> None:
    p.add_argument("model", metavar="MODEL_OR_CONFIG",
                   help="local HF folder, config.json path, or a known name such as llama:7b")
    p.add_argument("--world-size", "-w", type=int, required=True, metavar="N",
                   help="number of ranks to plan for (no processes are started)")
    p.add_argument("--mode", "-m", default=mode_default, required=mode_default is None, metavar="MODE",
                   help=f"tensor-parallel mode, one of {', '.join(MODE_NAMES)}; 'auto' ranks every valid "
                        f"(mode, q, d, dp) by predicted step time")
    p.add_argument("--depth", "-d", type=int, default=None, metavar="D",
                   help="2.5d depth d (world = dp·d·q²); with --mode auto it pins d")
    p.add_argument("--dp", type=int, default=None, metavar="R",
                   help="data-parallel replicas outside the TP mesh (default 1; searched with --mode auto)")
    p.add_argument("--cp", type=int, default=None, metavar="C",
                   help="context-parallel ranks: each replica's sequence is split C ways (world = dp·cp·the "
                        "mode's mesh; --seq-len a multiple of 2·C, or of C with --cp-order contiguous); "
                        "with --mode auto it pins cp (default: searched)")
    p.add_argument("--cp-attention", default="ring", choices=("ring", "gather", "auto"),
                   help="attention over the split sequence: 'ring' sends key/value blocks around the cp ring "
                        "(default), 'gather' all-gathers them, 'auto' keeps the one the cost model predicts faster")
    p.add_argument("--cp-order", default="balanced", choices=("balanced", "contiguous"),
                   help="the sequence's cp blocks: 'balanced' gives rank r chunks r and 2C-1-r of 2C (the same "
                        "causal-attention work on every rank; default), 'contiguous' gives rank r block r")
    p.add_argument("--batch-size", "-b", type=int, default=None, metavar="B",
                   help="global sequences per step (dp replicas split it); default: the smallest batch the "
                        "mode's batch split and dp accept (with --mode auto: one row per rank), said in the output")
    p.add_argument("--seq-len", "-s", type=int, default=128, metavar="S", help="tokens per sequence")
    p.add_argument("--cluster", "-c", default=None, metavar="PRESET",
                   help="hardware for the cost model: a preset (" + ", ".join(CLUSTER_NAMES)
                        + ") or a JSON file with the Cluster fields (default dgx-a100)")
    p.add_argument("--width", type=int, default=None, metavar="COLS",
                   help="console width for the tables (default: terminal width, at least 220)")


def build_parser() -> argparse.ArgumentParser:
    """The ``autoshard`` argument parser (``plan`` and ``check`` subcommands)."""
    known = ", ".join(KNOWN_MODELS)
    ap = argparse.ArgumentParser(
        prog="autoshard", formatter_class=_Help,
        description="Automatic tensor parallelism for Hugging Face models: print the sharding plan of a "
                    "model on a mesh (1d / 2d / 2.5d / 3d or auto), or check that it can be sharded.",
        epilog="run `autoshard plan --help` or `autoshard check --help` for the options and examples")
    sub = ap.add_subparsers(dest="command", required=True,
                            metavar="{plan,check,verify,diff,export,convert,profile,cache}")
    pp = sub.add_parser("plan", formatter_class=_Help, help="print the plan table, summary and cost",
                        description="Plan MODEL_OR_CONFIG on WORLD_SIZE ranks and print the per-node plan table, "
                                    "a per-rank summary (parameter, gradient, optimizer and activation bytes, "
                                    "predicted communication bytes and time per step, fallbacks) and, for "
                                    "--mode auto, the ranked candidates.",
                        epilog=_EPILOG_PLAN.format(known=known))
    _add_common(pp, mode_default="auto")
    pp.add_argument("--pp", type=int, default=1, metavar="P",
                    help="pipeline stages, outermost (world = pp·dp·cp·the mode's mesh): print the stages cut "
                         "between transformer blocks (blocks, bytes, time) and the schedule's bubble")
    pp.add_argument("--schedule", default=None, choices=("gpipe", "1f1b", "interleaved", "zbv"),
                    help="with --pp: torch's pipeline schedule (default 1f1b)")
    pp.add_argument("--micro-batches", type=int, default=None, metavar="M",
                    help="with --pp: micro-batches per step of --batch-size rows each (default: pp)")
    pp.add_argument("--json", metavar="PATH", default=None,
                    help="also write the plan, summary, cost and (auto) candidates as JSON")
    pp.add_argument("--all-nodes", action="store_true",
                    help="list every graph node in the plan table, not only linear/norm/attention/"
                         "embedding/loss and fallbacks")
    pp.add_argument("--no-table", action="store_true", help="skip the per-node plan table")
    pp.add_argument("--svg", metavar="PATH", default=None,
                    help="also draw the plan as SVG: which block of each weight (stem, head, first block) "
                         "lives on which rank, the mesh, one Linear's collectives")
    pp.add_argument("--top", type=int, default=12, metavar="K",
                    help="with --mode auto, show the K best candidates (and up to K dropped ones); 0 = all")
    pp.add_argument("--step", choices=("decode", "prefill"), default=None,
                    help="plan a generate() step instead of training: one token (decode) or the prompt "
                         "(prefill) per sequence with a static KV cache of --max-len positions; the summary "
                         "gives the KV cache per rank and the per-token collectives and predicted time")
    pp.add_argument("--max-len", type=int, default=None, metavar="L",
                    help="with --step, the positions the KV cache holds (default: --seq-len rounded up to 64)")
    cp = sub.add_parser("check", formatter_class=_Help, help="report whether a model can be sharded (exit 1 if not)",
                        description="Check MODEL_OR_CONFIG on WORLD_SIZE ranks without processes.",
                        epilog=_EPILOG_CHECK)
    _add_common(cp, mode_default=None)
    _add_verify(sub)
    _add_diff(sub)
    _add_export(sub)
    _add_convert(sub)
    _add_profile(sub)
    _add_cache(sub)
    return ap


_EPILOG_VERIFY = """\
MODEL is a local Hugging Face folder (config.json; weights optional), a config.json, a
known architecture:size ({known}) or pkg.module:function returning a model.

verify builds a shrunk random copy of MODEL (the same class and config switches, the
fewest layers that keep its layer pattern, the smallest widths that keep every split the
real layout makes; the report says what was shrunk and from what), starts N gloo ranks
itself (no torchrun, no GPU) and runs forward, backward and one SGD step sharded and dense
on the same batch. It prints each planned node's max |sharded - dense| (worst first), the
loss, logits, gradient and parameter differences, the collectives counted against the
plan's, and the share of the model that is split. --full uses the real sizes (and the
folder's weights) when N copies fit in this machine's memory.

exit status: 0 exact (fp32: atol = rtol = 1e-5; bf16: within twice the dense model's own
bf16 error), 1 a mismatch (the first node that differs is named), 2 refused (the node and
the reason) or bad arguments.

examples:
  autoshard verify llama:7b --world-size 8 --mode 2.5d --depth 2
  autoshard verify ./my-model --world-size 4 --mode 2d --dtype bf16
  autoshard verify mypkg.models:build --world-size 2 --mode 1d --json report.json
"""


def _add_verify(sub) -> None:
    vp = sub.add_parser("verify", formatter_class=_Help, help="prove a layout exact on CPU ranks (exit 1 if not)",
                        description="Shard a shrunk copy of MODEL on N local gloo ranks and compare it, node by "
                                    "node, with the dense model: forward, backward and one optimizer step.",
                        epilog=_EPILOG_VERIFY.format(known=", ".join(KNOWN_MODELS)))
    vp.add_argument("model", metavar="MODEL", help="local HF folder, config.json, known name (llama:7b) or "
                                                   "pkg.module:function")
    vp.add_argument("--world-size", "-w", type=int, required=True, metavar="N",
                    help="ranks to start (gloo, on this machine's CPUs)")
    vp.add_argument("--mode", "-m", required=True, metavar="MODE",
                    help=f"tensor-parallel mode, one of {', '.join(m for m in MODE_NAMES if m != 'auto')}")
    vp.add_argument("--depth", "-d", type=int, default=None, metavar="D", help="2.5d depth d (world = dp·d·q²)")
    vp.add_argument("--dp", type=int, default=1, metavar="R", help="data-parallel replicas outside the TP mesh")
    vp.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the dtype both runs compute in")
    vp.add_argument("--full", action="store_true",
                    help="the real sizes (and the folder's weights) instead of a shrunk copy")
    vp.add_argument("--batch-size", "-b", type=int, default=None, metavar="B",
                    help="global batch (default: the smallest that splits, with at least 2 rows per replica)")
    vp.add_argument("--seq-len", "-s", type=int, default=8, metavar="S",
                    help="tokens per row (rounded up to what the mode's sequence split needs)")
    vp.add_argument("--setup", default=None, metavar="PKG.MODULE:FN",
                    help="call this function on every rank first (e.g. to register a custom rule)")
    vp.add_argument("--timeout", type=float, default=600.0, metavar="SEC", help="limit for the whole run")
    vp.add_argument("--top", type=int, default=25, metavar="K", help="node rows to print, worst first; 0 = all")
    vp.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON")
    vp.add_argument("--width", type=int, default=None, metavar="COLS",
                    help="console width for the tables (default: terminal width, at least 220)")


def cmd_verify(args) -> int:
    from .verification import verify

    if args.mode == "auto":
        raise _UsageError("verify proves one layout: choose --mode from "
                          + ", ".join(m for m in MODE_NAMES if m != "auto")
                          + " (autoshard plan --mode auto shows which one the search picks)")
    console = _console(args.width)

    def progress(done, world):
        if sys.stderr.isatty():
            print(f"\r{done}/{world} ranks done", end="" if done < world else "\n", file=sys.stderr, flush=True)

    report = verify(args.model, world_size=args.world_size, mode=args.mode, depth=args.depth, dp=args.dp,
                    dtype=args.dtype, full=args.full, batch_size=args.batch_size, seq_len=args.seq_len,
                    setup=args.setup, timeout=args.timeout, progress=progress)
    report.show(console, top=args.top or None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1, default=str)
        console.print(f"wrote {args.json}")
    return report.exit_code


def _default_batch(args) -> None:
    """``--batch-size`` left out: the smallest global batch the layout splits, said on stderr."""
    if getattr(args, "batch_size", None) is not None:
        return
    from .ir.errors import ConfigError
    from .planning.validate import smallest_batch
    from .policies import make_policy

    if args.mode == "auto":
        args.batch_size = args.world_size
        print(f"batch {args.batch_size}: one row per rank, a batch every candidate layout splits; pass "
              f"--batch-size to choose another", file=sys.stderr)
        return
    try:
        pol = make_policy(args.mode, args.world_size, args.depth, args.dp or 1, getattr(args, "cp", None) or 1)
    except ConfigError:
        args.batch_size = args.dp or 1          # the mesh itself is the finding
        return
    args.batch_size, note = smallest_batch(pol, args.dp or 1)
    print(note, file=sys.stderr)


def _add_export(sub) -> None:
    ep = sub.add_parser("export", formatter_class=_Help, help="write a sharded checkpoint as a dense HF folder",
                        description="Merge a checkpoint written by save_checkpoint (any mode, any world size; "
                                    "e.g. a step_NNNNNN folder of examples/finetune.py) into a Hugging Face "
                                    "folder that AutoModelFor....from_pretrained loads: config.json naming the "
                                    "class that was sharded, and safetensors. One process, no torchrun.",
                        epilog="example:\n  autoshard export ckpt/step_000030 my-model/\n"
                               "  python -c \"import transformers as t; "
                               "t.AutoModelForSequenceClassification.from_pretrained('my-model')\"\n\n"
                               "exit status: 0 written, 2 bad arguments or an unreadable checkpoint.")
    ep.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint folder (manifest.json + rank files)")
    ep.add_argument("out", metavar="OUT", help="the folder to write")
    ep.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                    help="split the weights into files of at most SIZE (e.g. 500MB)")
    ep.add_argument("--model-class", default=None, metavar="CLASS",
                    help="transformers class to name in config.json (default: the class that was sharded)")


def _add_profile(sub) -> None:
    pp = sub.add_parser("profile", formatter_class=_Help,
                        help="measure this machine's Cluster (run under torchrun) and save it as JSON",
                        description="Time collectives, a matmul at several sizes, the per-op dispatch cost and "
                                    "the per-call cost of a collective on the ranks of this torchrun job "
                                    "(autoshard.profile), and write the Cluster that the cost model and "
                                    "--mode auto read: reuse it with `autoshard plan --cluster FILE` or "
                                    "shard(mode='auto', cluster=Cluster.load(FILE)).",
                        epilog="example:\n  torchrun --nproc-per-node 8 -m autoshard.cli profile --out cluster.json\n"
                               "  autoshard plan llama:tiny -w 8 -m auto --cluster cluster.json")
    pp.add_argument("--out", "-o", default="cluster.json", metavar="FILE", help="where rank 0 writes the JSON")
    pp.add_argument("--ranks-per-node", type=int, default=None, metavar="N",
                    help="ranks sharing a node (default: torchrun's LOCAL_WORLD_SIZE)")


def cmd_profile(args) -> int:
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise _UsageError("autoshard profile measures the ranks of a torchrun job: run it as "
                          "`torchrun --nproc-per-node N -m autoshard.cli profile --out cluster.json`")
    from .planning.profile import profile

    if not dist.is_initialized():
        from .runtime.device import init_process_group

        init_process_group()
    cluster = profile(ranks_per_node=args.ranks_per_node)
    if dist.get_rank() == 0:
        cluster.save(args.out)
        print(f"wrote {args.out}: {cluster.describe()}; per collective call {cluster.call_overhead * 1e6:.0f} µs, "
              f"per op {cluster.op_overhead * 1e6:.1f} µs, a pair of collectives sent together hides "
              f"{cluster.pair_overlap:.0%} of the shorter")
    dist.barrier()
    return 0


_EPILOG_CACHE = """\
The folder is AUTOSHARD_CACHE (default ~/.cache/autoshard/captures; `off` turns both caches
off; AUTOSHARD_LAUNCH_CACHE=off the launch cache alone). It holds two kinds of entries:
  capture  a captured graph (KEY.pt2), written by rank 0, read by every launch of the model
  launch   one rank's rewritten graph and plan (launch/KEY.bin), one per rank per layout
Keys fold in a hash of autoshard's source: entries of an edited checkout are never used, and
age out. After each store the least recently used entries are removed until the folder is
under AUTOSHARD_CACHE_MAX_MB (default 2048). A folder owned by another user, or writable by
group or others, is never read (a pickle runs code when loaded): fix it with `chmod 700 DIR`.

examples:
  autoshard cache list
  autoshard cache clear --kind launch
  AUTOSHARD_CACHE=/scratch/me/autoshard autoshard cache clear
"""


def _add_cache(sub) -> None:
    cp = sub.add_parser("cache", formatter_class=_Help, help="list or clear the on-disk capture and launch caches",
                        description="List or clear what autoshard keeps between launches: captured graphs and "
                                    "each rank's rewritten graph (autoshard/launch/cache_dir.py).",
                        epilog=_EPILOG_CACHE)
    ops = cp.add_subparsers(dest="cache_command", required=True, metavar="{list,clear}")
    ops.add_parser("list", formatter_class=_Help, help="print every entry (kind, key, size, age) and the total",
                   description="Print the cache folder, every entry (kind, key, size, time since it was last "
                               "stored or used; oldest first, the first to be evicted), the total and the bound.",
                   epilog=_EPILOG_CACHE)
    cl = ops.add_parser("clear", formatter_class=_Help, help="remove the entries (all, or of one kind)",
                        description="Remove the cache's entries: every one, or those of --kind.",
                        epilog=_EPILOG_CACHE)
    cl.add_argument("--kind", choices=("capture", "launch"), default=None,
                    help="remove only this kind's entries (default: both)")


def _add_diff(sub) -> None:
    dp = sub.add_parser("diff", formatter_class=_Help, help="compare two plans saved as JSON, node by node",
                        description="Print what changes between two plans of one model: per node (kernel, "
                                    "output spec, per-rank shape, weight slice, collectives, bytes), nodes only "
                                    "one plan has, parameters whose spec changed, and the plan-level figures.",
                        epilog="examples:\n  autoshard plan llama:tiny -w 4 -m 1d --no-table --json a.json\n"
                               "  autoshard plan llama:tiny -w 4 -m 2d --no-table --json b.json\n"
                               "  autoshard diff a.json b.json\n\n"
                               "exit status: 0 the plans are equal, 1 they differ, 2 bad arguments.")
    dp.add_argument("plan_a", metavar="PLAN_A.json", help="a plan: `autoshard plan --json` output or "
                                                         "ShardingPlan.to_json()")
    dp.add_argument("plan_b", metavar="PLAN_B.json", help="the plan to compare it with")
    dp.add_argument("--width", type=int, default=None, metavar="COLS",
                    help="console width for the table (default: terminal width, at least 220)")


# --------------------------------------------------------------------------- helpers

class _UsageError(Exception):
    pass


def _cluster(arg):
    from .planning.cost import Cluster

    if arg is None:
        return Cluster.preset("dgx-a100")
    if os.path.isfile(arg):
        return Cluster.load(arg)
    return Cluster.preset(arg)


def _seconds(s: float) -> str:
    if s < 1e-6:
        return f"{s * 1e9:,.1f} ns"
    return f"{s * 1e6:,.1f} µs" if s < 1e-3 else (f"{s * 1e3:,.2f} ms" if s < 1 else f"{s:,.3f} s")


def _console(width):
    from rich.console import Console

    if width is None:
        width = max(Console().width if sys.stdout.isatty() else 0, 220)
    return Console(width=width, highlight=False)


def summary(plan, cost) -> dict:
    """The plan's own summary merged with the cost model's figures."""
    s = plan.summary()
    s.update({f"predicted_{k}": v for k, v in cost.to_dict().items() if k not in ("notes",)})
    s["notes"] = list(cost.notes)
    return s


def print_summary(console, plan, cost, cluster) -> None:
    from rich.table import Table

    t = Table(title=f"per rank, per training step · {plan.mode} · mesh {plan.mesh} · {cluster.name}",
              show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    t.add_column("detail")
    t.add_row("batch × seq", f"{plan.batch_size} × {plan.seq_len}",
              f"global batch, split over dp={plan.dp} replicas" if plan.dp > 1 else "global batch")
    t.add_row("parameters", human_bytes(cost.param_bytes), f"{plan.param_bytes_per_rank:,} B")
    t.add_row("gradients", human_bytes(cost.grad_bytes), "same as parameters")
    t.add_row("optimizer state", human_bytes(cost.optimizer_bytes), "AdamW: 2 fp32 moments per parameter")
    t.add_row("activations", human_bytes(cost.activation_bytes),
              f"saved for backward (forward traced on meta, {cluster.device} attention)")
    t.add_row("memory total", human_bytes(cost.memory_bytes),
              ("fits in " if cost.fits else "DOES NOT FIT in ") + human_bytes(cluster.memory_bytes))
    t.add_row("comm bytes fwd / bwd", f"{human_bytes(plan.comm_bytes_per_rank('fwd'))} / "
              f"{human_bytes(cost.comm_bytes - plan.comm_bytes_per_rank('fwd'))}",
              f"{cost.collective_calls} collective calls, {human_bytes(cost.inter_node_bytes)} across nodes")
    t.add_row("comm time fwd / bwd", f"{_seconds(cost.comm_s_fwd)} / {_seconds(cost.comm_s_bwd)}",
              "alpha-beta per link class")
    t.add_row("compute time", _seconds(cost.compute_s), f"{cost.flops_fwd / 1e9:,.2f} GFLOP forward × 3")
    t.add_row("predicted step", _seconds(cost.step_s), "compute + comm, no overlap")
    fb = plan.fallbacks
    t.add_row("fallbacks", str(len(fb)), ", ".join(n.name for n in fb[:8]) + (" …" if len(fb) > 8 else ""))
    for n in cost.notes:
        t.add_row("note", "", n)
    console.print(t)


# --------------------------------------------------------------------------- commands

def _plan_or_search(args, cluster):
    from .api import plan as make_plan
    from .io.builder import model_from
    from .planning.search import search

    cfg = resolve_model(args.model)
    if getattr(args, "step", None):
        return make_plan(cfg, world_size=args.world_size, mode=args.mode, depth=args.depth, dp=args.dp or 1,
                         batch_size=args.batch_size, seq_len=args.seq_len, cluster=cluster, step=args.step,
                         max_len=args.max_len), None
    if args.mode == "auto":
        res = search(model_from(cfg), world_size=args.world_size, cluster=cluster, depth=args.depth,
                     dp=args.dp, batch_size=args.batch_size, seq_len=args.seq_len, raise_if_none=True,
                     cp=getattr(args, "cp", None), cp_attention=getattr(args, "cp_attention", "ring"),
                     cp_order=getattr(args, "cp_order", "balanced"))
        return res.plan, res
    p = make_plan(cfg, world_size=args.world_size, mode=args.mode, depth=args.depth, dp=args.dp or 1,
                  batch_size=args.batch_size, seq_len=args.seq_len, cp=getattr(args, "cp", None) or 1,
                  cp_attention=getattr(args, "cp_attention", "ring"), cp_order=getattr(args, "cp_order", "balanced"))
    return p, None


def cmd_plan(args) -> int:
    from .planning.cost import estimate
    from .ir.errors import AutoshardError

    console = _console(args.width)
    cluster = _cluster(args.cluster)
    if getattr(args, "pp", 1) != 1 or getattr(args, "schedule", None):
        return _plan_pipeline(args, cluster, console)
    try:
        plan, res = _plan_or_search(args, cluster)
    except AutoshardError as e:
        console.print(f"[bold red]error:[/bold red] {type(e).__name__}: {e}", markup=True, highlight=False)
        return 1
    if args.step:
        from .planning.cost import forward_latency

        if not args.no_table:
            console.print(plan.table(all_nodes=args.all_nodes))
        n = max((x.global_shape[2] for x in plan.nodes if x.kind == "state"), default=0)
        console.print(f"[bold]{args.step} step[/bold] ({plan.mode}, {plan.mesh}; batch {plan.batch_size}, KV cache "
                      f"of {n} positions): KV cache {plan.state_bytes_per_rank:,} B per rank · "
                      f"{len(plan.comms('fwd'))} collectives, {plan.comm_bytes_per_rank('fwd'):,.0f} B per rank per "
                      f"{'token' if args.step == 'decode' else 'prompt'} · predicted "
                      f"{forward_latency(plan, cluster) * 1e3:.2f} ms on {cluster.name}")
        if args.json:
            with open(args.json, "w") as f:
                f.write(plan.to_json())
        return 0
    cost = res.best.cost if res is not None else estimate(plan, cluster)
    if res is not None:
        res.show(console, top=args.top or None)
    if not args.no_table:
        console.print(plan.table(all_nodes=args.all_nodes))
    print_summary(console, plan, cost, cluster)
    if args.svg:
        console.print(f"wrote {plan.draw(args.svg)}")
    if args.json:
        out = {"summary": summary(plan, cost), "cluster": cluster.to_dict(), "plan": json.loads(plan.to_json())}
        if res is not None:
            out["search"] = res.to_dict()
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0


def _plan_pipeline(args, cluster, console) -> int:
    """``autoshard plan --pp P``: the stage table of
    :func:`autoshard.pipeline_parallel.plan_pipeline` and the summary of one stage's plan."""
    from .ir.errors import AutoshardError
    from .pipeline_parallel import plan_pipeline
    from .planning.cost import estimate

    try:
        pl = plan_pipeline(resolve_model(args.model), world_size=args.world_size, mode=args.mode, pp=args.pp,
                           schedule=args.schedule, depth=args.depth, dp=args.dp or 1, batch_size=args.batch_size or 1,
                           seq_len=args.seq_len, micro_batches=args.micro_batches, cluster=cluster)
    except AutoshardError as e:
        console.print(f"[bold red]error:[/bold red] {type(e).__name__}: {e}", markup=True, highlight=False)
        return 1
    if not args.no_table:
        console.print(pl.plan.table(all_nodes=args.all_nodes))
    print_summary(console, pl.plan, estimate(pl.plan, cluster), cluster)
    console.print(str(pl), markup=False, highlight=False)
    return 0


def check_problems(args, cluster=None) -> tuple[list[str], list[str], object]:
    """(problems, notes, plan-or-None) for the ``check`` command: every problem at once.

    The mesh, the model's dimensions against the split and the batch are checked as
    :func:`autoshard.shard` checks them (:mod:`autoshard.planning.validate`); then the model is
    planned, and planning errors, fallback nodes and (with a cluster) memory are added."""
    from .planning.cost import estimate
    from .ir.errors import ConfigError
    from .policies import make_policy
    from .planning.validate import check_dims

    problems, notes = [], []
    cfg = resolve_model(args.model)
    pol = None
    if args.mode != "auto":
        try:
            pol = make_policy(args.mode, args.world_size, args.depth, args.dp or 1, getattr(args, "cp", None) or 1)
        except ConfigError as e:
            problems.append(f"ConfigError: {e}")
    dp = args.dp or 1
    if args.batch_size % dp:
        problems.append(f"batch {args.batch_size} does not split over dp={dp} replicas; use a multiple of {dp}")
    if pol is not None:
        for p in check_dims(cfg, pol):
            (problems if p.error else notes).append(str(p))
        split, label = pol.batch_split()
        per = args.batch_size // dp
        if split > 1 and per % split:
            problems.append(f"batch {per} per replica does not split over the batch axes ({label}); "
                            f"use a global batch that is a multiple of {split * dp}")
    plan = None
    if pol is not None or args.mode == "auto":
        try:
            plan, _ = _plan_or_search(args, cluster or _cluster(None))
        except _UsageError:
            raise
        except Exception as e:      # every planning error is a finding here, not a crash
            problems.append(f"{type(e).__name__}: {e}")
    if plan is None:
        return problems, notes, None
    for n in plan.fallbacks:
        problems.append(f"fallback node {n.name} ({n.op}, {n.module or '-'}): " + ("; ".join(n.notes) or
                                                                                   "re-laid out to replicated"))
    if pol is None:     # auto: the batch axes are known once the search chose
        bsplit = plan.mesh.size(tuple(a for a in plan.batch_axes if a != "dp")) if plan.batch_axes else 1
        if plan.batch_size % bsplit:
            problems.append(f"batch {plan.batch_size} does not split over {','.join(plan.batch_axes)} "
                            f"({bsplit} blocks); use a multiple of {bsplit}")
    for pad in plan.padding():
        if pad.get("kind") == "width":
            notes.append(f"{pad['param']}: {pad['dense_shape']} padded to {pad['padded_shape']} for the {plan.mode} "
                         f"split; {'heads' if pad['unit'] > 1 else 'features'} per rank "
                         f"{', '.join(map(str, pad['shares']))} (exact; checkpoints keep {pad['dense_shape']})")
            continue
        v, vp = pad["dense_shape"][0] if pad["padded_shape"][0] != pad["dense_shape"][0] else pad["dense_shape"][-1], \
            max(set(pad["padded_shape"]) - set(pad["dense_shape"]), default=0)
        notes.append(f"vocab_size={v} is padded to {vp} for the {plan.mode} split: {pad['param']} holds "
                     f"{pad['padded_shape']} ({pad['extra_bytes_per_rank']:,} B of zero rows per rank; masked out of "
                     f"the loss, trimmed from outputs; checkpoints keep {pad['dense_shape']})")
    for n in plan.nodes:
        if n.kind == "linear" and n.weight == "replicated":
            # without the node names, the same reason in every layer is one grouped note
            why = "; ".join(re.sub(r" at node `[^`]*`", "", x) for x in n.notes)
            notes.append(f"{n.name} ({n.module}): weight replicated" + (f" — {why}" if why else ""))
    if cluster is not None:
        cost = estimate(plan, cluster)
        if not cost.fits:
            problems.append(f"needs {human_bytes(cost.memory_bytes)} per rank, {cluster.name} has "
                            f"{human_bytes(cluster.memory_bytes)}")
    return problems, notes, plan


def group_notes(notes: list[str]) -> list[tuple[str, list[str]]]:
    """Notes grouped by kind: ``"linear_3 (mlp.fc): weight replicated — why"`` has the kind
    ``"weight replicated — why"`` and the subject ``linear_3``; groups in first-seen order.

    >>> group_notes(["a (m.a): weight replicated", "b (m.b): weight replicated", "vocab: odd"])
    [('weight replicated', ['a', 'b']), ('vocab: odd', [])]
    """
    groups: dict[str, list[str]] = {}
    for n in notes:
        head, sep, kind = n.partition("): ")
        if sep and " (" in head:
            groups.setdefault(kind, []).append(head.split(" (", 1)[0])
        else:
            groups.setdefault(n, [])
    return list(groups.items())


def cmd_check(args) -> int:
    console = _console(args.width)
    cluster = _cluster(args.cluster) if args.cluster else None
    problems, notes, plan = check_problems(args, cluster)
    where = f"{args.model} on {args.world_size} ranks, mode {args.mode}"
    if plan is not None:
        where += f" (mesh {plan.mesh}, {plan.mode})"
    if plan is None and not problems:
        problems.append("no plan")
    if problems:                        # the verdict first, then what it rests on
        console.print(f"[bold red]✗[/bold red] {where}: {len(problems)} problem(s)")
        for p in problems:
            console.print(f"  - {p}", markup=False)
    else:
        console.print(f"[bold green]✓[/bold green] {where} can be sharded: "
                      f"{sum(1 for n in plan.nodes if n.kind != 'other')} planned nodes, no fallbacks")
    for kind, subjects in group_notes(notes):
        count = f" ×{len(subjects)}" if len(subjects) > 1 else ""
        who = (": " + ", ".join(subjects[:6]) + (f", … ({len(subjects) - 6} more)" if len(subjects) > 6 else "")
               if subjects else "")
        console.print(f"  note{count}: {kind}{who}", markup=False)
    whole = plan.whole_report() if plan is not None else ""
    if whole:       # what shard() warns
        console.print(f"  warning: {whole}", markup=False)
    return 1 if problems else 0


def read_plan(path: str):
    """A :class:`~autoshard.ir.plan.ShardingPlan` from a JSON file: the output of
    ``autoshard plan --json`` (its ``plan`` entry) or of ``ShardingPlan.to_json()``."""
    from .ir.plan import ShardingPlan

    try:
        with open(path) as f:
            d = json.load(f)
        return ShardingPlan.from_json(json.dumps(d["plan"] if "plan" in d else d))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _UsageError(f"cannot read a plan from {path!r} (want `autoshard plan --json` output or "
                          f"ShardingPlan.to_json()): {type(e).__name__}: {e}") from e


def cmd_diff(args) -> int:
    from .planning.plan_diff import counts, diff, table

    a, b = read_plan(args.plan_a), read_plan(args.plan_b)
    console = _console(args.width)
    changes = diff(a, b)
    if changes:
        console.print(table(a, b, changes))
    n = counts(changes)
    console.print(" · ".join(f"{k}: {v}" for k, v in n.items()) if changes else "the plans are equal")
    return 1 if changes else 0


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f} {unit}"
    return f"{max(seconds, 0):.0f} s"


def _megabytes(n: int) -> str:
    return f"{n / 2**20:,.2f} MB"


def cmd_cache(args) -> int:
    from .ir.errors import ConfigError
    from .launch import cache_dir

    base = cache_dir.root()
    if base is None:
        print("the cache is off (AUTOSHARD_CACHE=off): nothing is kept between launches")
        return 0
    if args.cache_command == "clear":
        gone = cache_dir.clear(args.kind)
        print(f"removed {len(gone)} entries ({_megabytes(sum(e.size for e in gone))}) from {base}")
        return 0
    found = cache_dir.entries(base)
    print(f"folder: {base}")
    try:
        cache_dir.check_folders()
    except ConfigError as e:
        print(f"refused (never read): {e}")
    if found:
        now = time.time()
        width = max(len(e.key) for e in found)
        print(f"{'kind':<8}  {'key':<{width}}  {'size':>12}  {'age':>7}")
        for e in found:
            print(f"{e.kind:<8}  {e.key:<{width}}  {_megabytes(e.size):>12}  {_age(e.age(now)):>7}")
    print(f"{len(found)} entries, {_megabytes(sum(e.size for e in found))} of {_megabytes(cache_dir.max_bytes())} "
          f"(AUTOSHARD_CACHE_MAX_MB)")
    return 0


def _add_convert(sub) -> None:
    cp = sub.add_parser("convert", formatter_class=_Help, help="convert between our checkpoint format and DCP",
                        description="Convert a checkpoint in one process, no torchrun. Our sharded format "
                                    "(manifest.json + rank files, from save_checkpoint) becomes a "
                                    "torch.distributed.checkpoint (DCP) folder that autoshard.io.dcp.load reads "
                                    "in any mode and world size; a DCP folder (from autoshard.io.dcp.save) becomes "
                                    "a dense Hugging Face folder, which from_pretrained loads in any mode and "
                                    "save_checkpoint writes in our format. The source's kind is detected.",
                        epilog="examples:\n  autoshard convert ckpt/step_000030 ckpt-dcp/     # ours -> DCP\n"
                               "  autoshard convert ckpt-dcp/ my-model/              # DCP -> HF folder\n\n"
                               "exit status: 0 written, 2 bad arguments or an unreadable checkpoint.")
    cp.add_argument("source", metavar="SOURCE", help="our checkpoint folder, or a DCP folder (.metadata)")
    cp.add_argument("out", metavar="OUT", help="the folder to write")


def cmd_convert(args) -> int:
    from pathlib import Path

    from .io.dcp import checkpoint_to_dcp, dcp_to_folder
    from .ir.errors import CheckpointError

    src = Path(args.source)
    if (src / ".metadata").exists():
        out = dcp_to_folder(src, args.out, progress=sys.stderr.isatty())
        print(f"wrote {out}: a dense Hugging Face folder ({', '.join(sorted(p.name for p in out.iterdir()))})")
    elif (src / "manifest.json").exists():
        out = checkpoint_to_dcp(src, args.out)
        print(f"wrote {out}: a DCP checkpoint (load it with autoshard.io.dcp.load in any mode)")
    else:
        raise CheckpointError(f"{src}: neither our checkpoint (manifest.json) nor a DCP one (.metadata)")
    return 0


def cmd_export(args) -> int:
    from .io.builder import resolve_class
    from .io.export import export_checkpoint

    cls = resolve_class(None, args.model_class) if args.model_class else None
    from pathlib import Path

    if (Path(args.checkpoint) / "adapter_config.json").exists():     # saved from a sharded peft model
        from .adapters import export_merged

        out = export_merged(args.checkpoint, args.out, model_class=cls, max_shard_size=args.max_shard_size)
        print(f"wrote {out} (the LoRA adapter merged into the base: "
              f"{', '.join(sorted(p.name for p in out.iterdir()))})")
        return 0
    out = export_checkpoint(args.checkpoint, args.out, model_class=cls, max_shard_size=args.max_shard_size,
                            progress=sys.stderr.isatty())
    print(f"wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``autoshard`` console script."""
    from .ir.errors import CheckpointError, ConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "mode", None) is not None and args.mode not in MODE_NAMES:     # diff has no --mode
        parser.error(f"argument --mode/-m: invalid choice: {args.mode!r} (choose from {', '.join(MODE_NAMES)})")
    for name in ("world_size", "depth", "dp", "batch_size", "seq_len"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        if args.command in ("plan", "check"):
            _default_batch(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "verify":
            return cmd_verify(args)
        if args.command == "diff":
            return cmd_diff(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "convert":
            return cmd_convert(args)
        if args.command == "profile":
            return cmd_profile(args)
        if args.command == "cache":
            return cmd_cache(args)
        return cmd_check(args)
    except _UsageError as e:
        print(f"autoshard: error: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:          # a bad --cluster and the like, before any planning
        print(f"autoshard: error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:      # export: a missing, partial or corrupt checkpoint
        print(f"autoshard: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
