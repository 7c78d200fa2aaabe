"""``autoshard cache``: list or clear the on-disk capture and launch caches."""

from __future__ import annotations

import time

from .common import HelpFormatter

__all__ = ["add_cache", "cmd_cache"]

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


def add_cache(sub) -> None:
    cp = sub.add_parser("cache", formatter_class=HelpFormatter, help="list or clear the on-disk capture and launch caches",
                        description="List or clear what autoshard keeps between launches: captured graphs and "
                                    "each rank's rewritten graph (autoshard/launch/cache_dir.py).",
                        epilog=_EPILOG_CACHE)
    ops = cp.add_subparsers(dest="cache_command", required=True, metavar="{list,clear}")
    ops.add_parser("list", formatter_class=HelpFormatter, help="print every entry (kind, key, size, age) and the total",
                   description="Print the cache folder, every entry (kind, key, size, time since it was last "
                               "stored or used; oldest first, the first to be evicted), the total and the bound.",
                   epilog=_EPILOG_CACHE)
    cl = ops.add_parser("clear", formatter_class=HelpFormatter, help="remove the entries (all, or of one kind)",
                        description="Remove the cache's entries: every one, or those of --kind.",
                        epilog=_EPILOG_CACHE)
    cl.add_argument("--kind", choices=("capture", "launch"), default=None,
                    help="remove only this kind's entries (default: both)")


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f} {unit}"
    return f"{max(seconds, 0):.0f} s"


def _megabytes(n: int) -> str:
    return f"{n / 2**20:,.2f} MB"


def cmd_cache(args) -> int:
    from ..ir.errors import ConfigError
    from ..launch import cache_dir

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
