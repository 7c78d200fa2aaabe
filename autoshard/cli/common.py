"""What the subcommands share: the mode and cluster names (no torch needed for
``--help``), the help formatter, the usage error (exit status 2), the console and
the number formats."""

from __future__ import annotations

import argparse
import os
import sys

from ..ir.heap import collector_paused  # noqa: F401 - the planning commands run in it

__all__ = ["MODE_NAMES", "CLUSTER_NAMES", "HelpFormatter", "UsageError", "human_bytes", "cluster_from",
           "seconds", "console_for", "collector_paused"]

# Named here so `autoshard --help` needs no torch (policies and the cost model import it);
# tests/test_cli.py checks them against POLICIES and CLUSTERS.
MODE_NAMES = ("auto", "1d", "1d-sp", "2d", "2.5d", "3d")
CLUSTER_NAMES = ("dgx-a100", "h100-sxm", "cpu-gloo", "tesseract-paper")


def human_bytes(n: float) -> str:
    """:func:`autoshard.planning.cost.human_bytes`, imported on first use."""
    from ..planning.cost import human_bytes as hb

    return hb(n)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Adds "(default: X)" to an option's help unless the help already names its default."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default" in h.lower() or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return h
        return h + " (default: %(default)s)"


class UsageError(Exception):
    """A bad use of a subcommand: printed as ``autoshard: error: ...``, exit status 2."""


def cluster_from(arg):
    from ..planning.cost import Cluster

    if arg is None:
        return Cluster.preset("dgx-a100")
    if os.path.isfile(arg):
        return Cluster.load(arg)
    return Cluster.preset(arg)


def seconds(s: float) -> str:
    if s < 1e-6:
        return f"{s * 1e9:,.1f} ns"
    return f"{s * 1e6:,.1f} µs" if s < 1e-3 else (f"{s * 1e3:,.2f} ms" if s < 1 else f"{s:,.3f} s")


def console_for(width):
    from rich.console import Console

    if width is None:
        width = max(Console().width if sys.stdout.isatty() else 0, 220)
    return Console(width=width, highlight=False)
