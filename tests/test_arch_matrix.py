"""The architecture matrix (tests/arch_matrix.py): every architecture × mode,
sharded vs dense on gloo ranks (logits, loss, every local gradient within
atol = rtol = 1e-5; parameter bytes and collective ledger equal to the plan;
fallback nodes equal to what docs/support.md reports), and docs/support.md
regenerated from the plans and compared with the committed file.

One export per architecture and worker is shared by the modes run on that
pool (1d and 2d on 4 ranks; 2.5d and 3d on 8). 8-rank cells are slow except a
few (arch_matrix.EIGHT_RANK_DEFAULT)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import arch_matrix as M
import models
from dist_pool import get_pool


@pytest.fixture(scope="module")
def cells():
    """{(arch, mode): Cell} from plans only (one meta export per architecture)."""
    return M.collect()


def test_support_md_is_generated_from_the_matrix(cells):
    with open(M.SUPPORT_MD) as f:
        committed = f.read()
    assert M.render(cells) == committed, ("docs/support.md is stale: run "
                                          "`.venv/bin/python tests/arch_matrix.py` and commit it")


def test_matrix_covers_the_issue(cells):
    """At least 10 architectures beyond nothing-special, in every mode, none refused silently."""
    archs = {a for a, _ in cells}
    assert len(archs) >= 10
    assert {m for _, m in cells} == {m for m, _, _ in M.MODES}
    for (a, m), c in cells.items():
        assert c.status in ("pass", "fallbacks", "refused"), (a, m)
        if c.status == "refused":
            assert "node" in c.reason, (a, m, c.reason)


def _id(c):
    return f"{c[0]}-{c[1]}"


CASES = [(a, m) for a in M.ARCHS for m, _, _ in M.MODES]
PARAMS = [pytest.param(a, m, id=f"{a}-{m}", marks=[pytest.mark.slow] if M.is_slow(a, m) else [])
          for a, m in CASES]


@pytest.mark.parametrize("arch,mode", PARAMS)
def test_arch_mode_equals_dense(arch, mode, cells):
    cell = cells[arch, mode]
    _, world, depth = next(x for x in M.MODES if x[0] == mode)
    if cell.status == "refused":
        from autoshard.errors import AutoshardError

        with pytest.raises(AutoshardError):
            M.plan_cell(M.capture_arch(arch), mode)
        return
    results = get_pool(world, timeout=600).run(models.check, arch, mode, depth, 0, None, 1, True)
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: {r['failures']}"
        assert r["param_bytes"] == r["plan_param_bytes"], f"rank {rank}"
        assert (r["ledger_bytes"], r["ledger_calls"]) == (r["plan_bytes"], r["plan_calls"]), f"rank {rank}"
        assert r["n_local_params"] == r["n_dense_params"], "tied weights must stay one parameter"
        # the run's plan (real weights, this worker's export) is the reported one
        assert r["fallbacks"] == cell.fallback_nodes, f"rank {rank}"


def test_check_lists_fallback_nodes(tmp_path, cells):
    """`autoshard check` names each fallback row of a cell that has them."""
    arch, mode = next(((a, m) for (a, m), c in cells.items() if c.status == "fallbacks" and m == "2d"))
    import transformers

    _, cfg_cls, kw, _ = M.ARCHS[arch]
    cfg = getattr(transformers, cfg_cls)(**kw)
    cfg.architectures = [M.ARCHS[arch][0]]
    cfg.to_json_file(str(tmp_path / "config.json"))
    env = {**os.environ, "COLUMNS": "250", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "autoshard.cli", "check", str(tmp_path / "config.json"),
                        "--world-size", "4", "--mode", mode, "--batch-size", "4", "--seq-len", "8"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    for name in cells[arch, mode].fallback_nodes:
        assert f"fallback node {name} " in r.stdout, name


def test_refused_cell_is_reported_with_its_reason():
    """A refusal is a documented result: the table says refused, the details name node and reason."""
    from autoshard.errors import ShardingError

    class _Node:
        meta: dict = {}

        def format_node(self):
            return "%reshape_1 : call_function[target=aten.reshape](...)"

    cell = M.refused(ShardingError("cannot gather the batch split", node=_Node()))
    text = M.render({("bloom", "2d"): cell})
    assert "**refused**" in text
    assert "refused: ShardingError: cannot gather the batch split (node: %reshape_1" in text
