"""``autoshard diff``: two plans saved as JSON, compared node by node."""

from __future__ import annotations

import json

from .common import HelpFormatter, UsageError, console_for

__all__ = ["add_diff", "read_plan", "cmd_diff"]


def add_diff(sub) -> None:
    dp = sub.add_parser("diff", formatter_class=HelpFormatter, help="compare two plans saved as JSON, node by node",
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
    dp.add_argument("--all-layers", action="store_true",
                    help="list every layer's changes; by default a run of layers whose changes are those of a "
                         "layer above (up to the layer index and node numbering) is one 'same as' row")
    dp.add_argument("--width", type=int, default=None, metavar="COLS",
                    help="console width for the table (default: terminal width, at least 220)")


def read_plan(path: str):
    """A :class:`~autoshard.ir.plan.ShardingPlan` from a JSON file: the output of
    ``autoshard plan --json`` (its ``plan`` entry) or of ``ShardingPlan.to_json()``."""
    from ..ir.plan import ShardingPlan

    try:
        with open(path) as f:
            d = json.load(f)
        return ShardingPlan.from_json(json.dumps(d["plan"] if "plan" in d else d))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"cannot read a plan from {path!r} (want `autoshard plan --json` output or "
                          f"ShardingPlan.to_json()): {type(e).__name__}: {e}") from e


def cmd_diff(args) -> int:
    from ..planning.plan_diff import counts, diff, table

    a, b = read_plan(args.plan_a), read_plan(args.plan_b)
    console = console_for(args.width)
    changes = diff(a, b)
    if changes:
        console.print(table(a, b, changes, all_layers=args.all_layers))
    n = counts(changes)
    console.print(" · ".join(f"{k}: {v}" for k, v in n.items()) if changes else "the plans are equal")
    return 1 if changes else 0
