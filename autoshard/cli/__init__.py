"""``autoshard`` command line: plan a model on a mesh, or check it can be sharded.

No processes and no weights: the model is built on the meta device from a local
Hugging Face folder, a ``config.json``, or a known architecture name
(``llama:7b``, ``gpt2:small``, ...; see ``autoshard plan --help``).

One module per subcommand (or pair): :mod:`.plan` (plan, check), :mod:`.verify`,
:mod:`.diff`, :mod:`.checkpoints` (export, convert), :mod:`.profile`, :mod:`.cache`;
:mod:`.common` holds what they share. None imports torch at import time, so
``autoshard --help`` needs none.
"""

from __future__ import annotations

import argparse
import gc
import sys

from ..known import DEFAULT_SIZES, KNOWN_MODELS, resolve_model  # noqa: F401 - the CLI's names too
from .cache import add_cache, cmd_cache
from .checkpoints import add_convert, add_export, cmd_convert, cmd_export
from .common import CLUSTER_NAMES, MODE_NAMES, HelpFormatter, UsageError, collector_paused, human_bytes
from .diff import add_diff, cmd_diff
from .plan import add_check, add_plan, cmd_check, cmd_plan, default_batch, group_notes
from .profile import add_profile, cmd_profile
from .verify import add_verify, cmd_verify

__all__ = ["main", "cmd_verify", "KNOWN_MODELS", "resolve_model", "build_parser", "human_bytes", "group_notes", "MODE_NAMES", "CLUSTER_NAMES"]


def build_parser() -> argparse.ArgumentParser:
    """The ``autoshard`` argument parser (``plan`` and ``check`` subcommands)."""
    known = ", ".join(KNOWN_MODELS)
    ap = argparse.ArgumentParser(
        prog="autoshard", formatter_class=HelpFormatter,
        description="Automatic tensor parallelism for Hugging Face models: print the sharding plan of a "
                    "model on a mesh (1d / 2d / 2.5d / 3d or auto), or check that it can be sharded.",
        epilog="run `autoshard plan --help` or `autoshard check --help` for the options and examples")
    sub = ap.add_subparsers(dest="command", required=True,
                            metavar="{plan,check,verify,diff,export,convert,profile,cache}")
    add_plan(sub, known)
    add_check(sub)
    add_verify(sub)
    add_diff(sub)
    add_export(sub)
    add_convert(sub)
    add_profile(sub)
    add_cache(sub)
    return ap


def _no_final_collection() -> None:
    """Move every live object out of the collector's reach (:func:`gc.freeze`) as the process
    ends. The interpreter's shutdown runs one full collection even with the collector
    disabled, and after a plan it walks the whole heap of torch, transformers and the
    capture: ~1.4 s of a cold ``autoshard plan llama:7b -w 64 --mode auto`` (~7.4 s in
    all), for garbage the process's exit frees anyway (docs/design.md, "Pricing the search").
    Only for the process's own command line (``main()`` without ``argv``): a caller that
    goes on keeps its collector whole."""
    gc.freeze()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``autoshard`` console script."""
    from ..ir.errors import CheckpointError, ConfigError

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
            with collector_paused():        # the planning commands, start to end
                default_batch(args)
                rc = cmd_plan(args) if args.command == "plan" else cmd_check(args)
            if argv is None:                # this process's own command line: it ends now
                _no_final_collection()
            return rc
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
        return cmd_cache(args)
    except UsageError as e:
        print(f"autoshard: error: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:          # a bad --cluster and the like, before any planning
        print(f"autoshard: error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:      # export: a missing, partial or corrupt checkpoint
        print(f"autoshard: error: {e}", file=sys.stderr)
        return 2
