"""``autoshard verify``: a shrunk copy of a model sharded on local gloo ranks and compared,
node by node, with the dense model (:mod:`autoshard.verification`)."""

from __future__ import annotations

import json
import sys

from ..known import KNOWN_MODELS
from .common import MODE_NAMES, HelpFormatter, UsageError, console_for

__all__ = ["add_verify", "cmd_verify"]

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


def add_verify(sub) -> None:
    vp = sub.add_parser("verify", formatter_class=HelpFormatter, help="prove a layout exact on CPU ranks (exit 1 if not)",
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
    from ..verification import verify

    if args.mode == "auto":
        raise UsageError("verify proves one layout: choose --mode from "
                          + ", ".join(m for m in MODE_NAMES if m != "auto")
                          + " (autoshard plan --mode auto shows which one the search picks)")
    console = console_for(args.width)

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
