"""Every command the README and the ``docs/`` pages show, run as written.

A command is a line of a fenced block that starts with ``$ `` (a console transcript)
or, in a block without a prompt, a line that starts with a command this project
ships (``autoshard``, ``torchrun``, ``make``, ``.venv/bin/...``, ``python``). Lines
that continue with a trailing ``\\`` are joined. Commands that cannot run on a CPU-only
machine without network, or that name a placeholder the reader supplies, are listed
in :data:`SKIP` with the reason, and reported as skipped, never silently dropped.

    .venv/bin/python tests/docs_commands.py --list        # what would run, and what is skipped
    .venv/bin/python tests/docs_commands.py               # run them all (minutes: torchrun examples)
    .venv/bin/python tests/docs_commands.py -k plan       # only those whose text contains "plan"

Commands run from the repository root with ``.venv/bin`` first on ``PATH``, in a
scratch directory for relative outputs (``--json 1d.json``), each with a time limit.
Exit status 1 if any fails.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTS = ("autoshard ", "torchrun ", "make ", ".venv/bin/", "python ", "pip ")

# (substring, why): a command containing it is not run here
SKIP = (
    ("make test-gpu", "needs a GPU (docs/gpus.md)"),
    ("make test", "the test suite: CI runs it (.ci/run), about 10 minutes"),
    ("make demo", "CI's clean-clone check runs it; `python examples/shard_and_inspect.py` covers the same code"),
    ("pip install", "installs packages (network)"),
    ("--nnodes", "two machines"),
    ("train.py", "a user's own script (docs/gpus.md shows the launch line)"),
    ("torchrun --nproc-per-node 4 generate.py", "a user's own script"),
    ("./my-model", "a placeholder: the reader's folder"),
    ("mypkg.models", "a placeholder: the reader's package"),
    ("profile --out cluster.json", "measures this machine's links with 8 ranks (minutes); choosing.md's next line "
                                   "reads its output"),
    ("--cluster cluster.json", "reads the profile the skipped line above writes"),
    ("sentence_transformers_encode.py", "needs the optional `clients` extra (sentence-transformers)"),
    ("trl_sft.py", "needs the optional `clients` extra (trl)"),
)

# (substring, exit statuses that mean it worked): commands whose status reports a finding
EXPECT = (("autoshard diff", (0, 1)),)      # 1: the plans differ (what the page shows)


def commands(paths: list[str]) -> list[tuple[str, int, str]]:
    """``(file, line, command)`` for every command in the fenced blocks of ``paths``."""
    out = []
    for path in paths:
        lines = open(path, encoding="utf-8").read().splitlines()
        fence = False
        pending = ""
        for i, line in enumerate(lines, 1):
            if line.lstrip().startswith("```"):
                fence, pending = not fence, ""
                continue
            if not fence:
                continue
            text = line.strip()
            if pending:
                pending += " " + text.rstrip("\\").strip()
                if not text.endswith("\\"):
                    out.append((path, start, pending))
                    pending = ""
                continue
            if text.startswith("$ "):
                text = text[2:]
            elif not text.startswith(STARTS) or " · " in text:     # "autoshard plan · ..." is a table's title
                continue
            text = re.sub(r"\s+#\s.*$", "", text)       # a trailing comment
            if text.endswith("\\"):
                pending, start = text[:-1].strip(), i
                continue
            out.append((path, i, text))
    return out


def skip_reason(cmd: str) -> str | None:
    return next((why for s, why in SKIP if s in cmd), None)


def doc_paths() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))


def run(cmd: str, scratch: str, timeout: int) -> tuple[int, float, str]:
    """``(exit status, seconds, last lines of output)`` of ``cmd`` run from the repository root."""
    env = dict(os.environ, PATH=os.path.join(ROOT, ".venv", "bin") + os.pathsep + os.environ.get("PATH", ""),
               PYTHONUNBUFFERED="1")
    # relative outputs (--json x.json, --checkpoint-dir) land in the scratch folder; the
    # repository's own paths (examples/, .venv/) are reached from it through links
    for name in ("examples", ".venv", "docs", "tests", "benchmarks"):
        link = os.path.join(scratch, name)
        if not os.path.exists(link):
            os.symlink(os.path.join(ROOT, name), link)
    t0 = time.time()
    try:
        p = subprocess.run(cmd, shell=True, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"timed out after {timeout} s\n{(e.stdout or b'')[-2000:]!r}"
    return rc, time.time() - t0, "\n".join(text.strip().splitlines()[-8:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the commands and the skipped ones; run nothing")
    ap.add_argument("-k", default=None, help="run only the commands whose text contains this")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per command (default 600)")
    args = ap.parse_args(argv)
    found = commands(doc_paths())
    if args.k:
        found = [c for c in found if args.k in c[2]]
    seen: set[str] = set()
    failed = 0
    scratch = tempfile.mkdtemp(prefix="autoshard-docs-")
    for path, line, cmd in found:
        where = f"{os.path.relpath(path, ROOT)}:{line}"
        why = skip_reason(cmd)
        if why or cmd in seen:
            print(f"skip  {where:24} {cmd}  ({why or 'run above'})")
            continue
        seen.add(cmd)
        if args.list:
            print(f"run   {where:24} {cmd}")
            continue
        rc, secs, tail = run(cmd, scratch, args.timeout)
        rc = 0 if rc in next((ok for s, ok in EXPECT if s in cmd), (0,)) else rc
        print(f"{'ok' if rc == 0 else 'FAIL':5} {where:24} {cmd}  ({secs:.1f} s)", flush=True)
        if rc:
            failed += 1
            print("      " + tail.replace("\n", "\n      "), flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    if not args.list:
        print(f"{len(seen) - failed} ran, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
