"""``autoshard plan`` and ``autoshard check``: a model planned on a mesh without
processes or weights, its per-node table, summary and predicted cost; or every
problem that would stop it being sharded."""

from __future__ import annotations

import argparse
import json
import re
import sys

from ..known import resolve_model
from .common import MODE_NAMES, CLUSTER_NAMES, HelpFormatter, UsageError, cluster_from, console_for, human_bytes, seconds

__all__ = ["add_plan", "add_check", "default_batch", "summary", "print_summary", "cmd_plan", "check_problems",
           "group_notes", "cmd_check"]

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


def add_plan(sub, known: str) -> None:
    """The ``plan`` subcommand's parser (``known``: the known architecture names, for its epilog)."""
    pp = sub.add_parser("plan", formatter_class=HelpFormatter, help="print the plan table, summary and cost",
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


def add_check(sub) -> None:
    """The ``check`` subcommand's parser."""
    cp = sub.add_parser("check", formatter_class=HelpFormatter, help="report whether a model can be sharded (exit 1 if not)",
                        description="Check MODEL_OR_CONFIG on WORLD_SIZE ranks without processes.",
                        epilog=_EPILOG_CHECK)
    _add_common(cp, mode_default=None)


def default_batch(args) -> None:
    """``--batch-size`` left out: the smallest global batch the layout splits, said on stderr."""
    if getattr(args, "batch_size", None) is not None:
        return
    from ..ir.errors import ConfigError
    from ..planning.validate import smallest_batch
    from ..policies import make_policy

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
    t.add_row("comm time fwd / bwd", f"{seconds(cost.comm_s_fwd)} / {seconds(cost.comm_s_bwd)}",
              "alpha-beta per link class")
    t.add_row("compute time", seconds(cost.compute_s), f"{cost.flops_fwd / 1e9:,.2f} GFLOP forward × 3")
    t.add_row("predicted step", seconds(cost.step_s), "compute + comm, no overlap")
    fb = plan.fallbacks
    t.add_row("fallbacks", str(len(fb)), ", ".join(n.name for n in fb[:8]) + (" …" if len(fb) > 8 else ""))
    for n in cost.notes:
        t.add_row("note", "", n)
    console.print(t)


def _plan_or_search(args, cluster):
    from ..api import plan as make_plan
    from ..io.builder import model_from
    from ..planning.search import search

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
    """``autoshard plan``: with the cyclic garbage collector paused (re-enabled after, unless it
    was off). Its full collections re-scanned torch's and the capture's objects (~500 k) some
    ten times a run, about 1.5 s CPU of 10 for ``llama:7b --world-size 64 --mode auto``; the
    command leaves little cyclic garbage (docs/design.md, "Pricing the search")."""
    import gc

    pause = gc.isenabled()
    gc.disable()
    try:
        return _cmd_plan(args)
    finally:
        if pause:
            gc.enable()


def _cmd_plan(args) -> int:
    from ..planning.cost import estimate
    from ..ir.errors import AutoshardError

    console = console_for(args.width)
    cluster = cluster_from(args.cluster)
    if getattr(args, "pp", 1) != 1 or getattr(args, "schedule", None):
        return _plan_pipeline(args, cluster, console)
    try:
        plan, res = _plan_or_search(args, cluster)
    except AutoshardError as e:
        console.print(f"[bold red]error:[/bold red] {type(e).__name__}: {e}", markup=True, highlight=False)
        return 1
    if args.step:
        from ..planning.cost import forward_latency

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
    from ..ir.errors import AutoshardError
    from ..pipeline_parallel import plan_pipeline
    from ..planning.cost import estimate

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
    from ..planning.cost import estimate
    from ..ir.errors import ConfigError
    from ..policies import make_policy
    from ..planning.validate import check_dims

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
            plan, _ = _plan_or_search(args, cluster or cluster_from(None))
        except UsageError:
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
    console = console_for(args.width)
    cluster = cluster_from(args.cluster) if args.cluster else None
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
