"""The README's and docs/ pages' commands name files and subcommands that exist
(cheap, static); ``make docs-check`` runs them (tests/docs_commands.py)."""

from __future__ import annotations

import os
import re

from docs_commands import ROOT, commands, doc_paths, skip_reason

from autoshard.cli import build_parser


def test_the_pages_show_commands_and_each_runnable_one_names_what_exists():
    found = commands(doc_paths())
    assert len(found) > 20
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    for path, line, cmd in found:
        if skip_reason(cmd):
            continue
        where = f"{os.path.relpath(path, ROOT)}:{line}: {cmd}"
        for script in re.findall(r"(\S+\.py)\b", cmd):
            assert os.path.exists(os.path.join(ROOT, script)), where
        m = re.match(r"autoshard (\w+)", cmd)
        if m:
            assert m.group(1) in subcommands, where


def test_continued_lines_join_and_titles_are_not_commands(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("```console\n$ torchrun a.py --x 1 \\\n      --y 2\nstep 1 loss 3\n```\n"
                    "```\nautoshard plan · Llama · 1d\nautoshard plan llama:tiny -w 4   # a comment\n```\n")
    assert commands([str(page)]) == [(str(page), 2, "torchrun a.py --x 1 --y 2"),
                                     (str(page), 8, "autoshard plan llama:tiny -w 4")]
