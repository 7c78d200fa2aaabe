"""Importing autoshard is cheap: the package resolves its public names lazily
(PEP 562), so ``import autoshard`` / ``import autoshard.ir.spec`` load neither
torch.distributed nor transformers, and the public names still resolve."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("stmt", ["import autoshard", "import autoshard.ir.spec", "import autoshard.ir.mesh",
                                  "import autoshard.ir.errors"])
def test_import_loads_no_distributed_or_transformers(stmt):
    r = _run(f"{stmt}, sys; heavy = [m for m in ('torch.distributed', 'transformers') if m in sys.modules]; "
             f"assert not heavy, heavy")
    assert r.returncode == 0, r.stderr


def test_public_names_resolve_lazily():
    r = _run("import autoshard, sys\n"
             "assert 'autoshard.api' not in sys.modules\n"
             "assert set(autoshard.__all__) <= set(dir(autoshard))\n"
             "for n in autoshard.__all__: getattr(autoshard, n)\n"
             "import autoshard.ir.plan, autoshard.planning.search\n"    # modules named like the functions
             "assert callable(autoshard.plan) and autoshard.plan.__module__ == 'autoshard.api', autoshard.plan\n"
             "assert autoshard.search.__module__ == 'autoshard.planning.search' and callable(autoshard.search)\n"
             "from autoshard import plan, shard, ShardSpec, load_checkpoint\n"
             "assert plan is autoshard.plan\n")
    assert r.returncode == 0, r.stderr


def test_unknown_name_is_attribute_error():
    import autoshard

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        autoshard.nope  # noqa: B018
