"""The architecture matrix (tests/arch_matrix.py): every architecture × mode,
sharded vs dense on gloo ranks (logits, loss, every local gradient within
atol = rtol = 1e-5; parameter bytes and collective ledger equal to the plan;
fallback nodes equal to what docs/support.md reports), and docs/support.md
regenerated from the plans and compared with the committed file.

One export per architecture and worker is shared by the modes run on that
pool (1d and 2d on 4 ranks; 2.5d and 3d on 8). 8-rank cells are slow except a
few (arch_matrix.EIGHT_RANK_DEFAULT). The gpt2 / llama / bert cells run in
tests/test_equivalence.py (arch_matrix.IN_EQUIVALENCE; checked below)."""

from __future__ import annotations

import pytest

import arch_matrix as M
import models
from dist_pool import get_pool


def _collect_share(rank, world):
    return M.collect(list(M.ARCHS)[rank::world])


@pytest.fixture(scope="module")
def cells():
    """{(arch, mode): Cell} from plans only (one meta export per architecture). The
    two ranks of a pool plan half the architectures each: one core each, and no
    process group is used."""
    found = {}
    for part in get_pool(2, timeout=600).run(_collect_share):
        found.update(part)
    return {(a, m): found[a, m] for a in M.ARCHS for m, _, _ in M.MODES}


# the report checks plan all 84 cells (137 s of a loaded `make test`): make test-extended
@pytest.mark.slow
def test_support_md_is_generated_from_the_matrix(cells):
    with open(M.SUPPORT_MD) as f:
        committed = f.read()
    assert M.render(cells, M.collect_modality(), M.collect_recent(), M.collect_plain()) == committed, ("docs/support.md is stale: run "
                                          "`.venv/bin/python tests/arch_matrix.py` and commit it")


@pytest.mark.slow
def test_matrix_covers_the_issue(cells):
    """At least 10 architectures beyond nothing-special, in every mode, each cell with
    the verdict it is known to have (arch_matrix.EXPECTED_FALLBACKS; the rest pass)."""
    archs = {a for a, _ in cells}
    assert len(archs) >= 10
    assert set(cells) == {(a, m) for a in M.ARCHS for m, _, _ in M.MODES}
    assert {k: c.status for k, c in cells.items()} == {k: M.expected_status(*k) for k in cells}
    assert all(("(node: %" in c.reason) == (c.status == "refused") for c in cells.values())


def test_cells_left_to_the_equivalence_tests_are_run_there():
    """Every cell the matrix does not run is a case of test_equivalence.py with the same
    model config, mode, world size and depth, and passes without fallbacks."""
    import test_equivalence

    cases = {(name, mode, world, depth) for name, world, mode, depth, _ in test_equivalence.CASES}
    for a, m in M.IN_EQUIVALENCE:
        _, world, depth = next(x for x in M.MODES if x[0] == m)
        assert (a, m, world, depth) in cases, (a, m)
        assert models.TINY[a] == M.ARCHS[a][:3], a
        assert M.expected_status(a, m) == "pass", (a, m)


def test_moe_cells_are_run_by_test_moe():
    """The mixtral cells are cases of test_moe.py: the same config, mode, world and depth."""
    import test_moe

    cases = {(m, w, d) for m, w, d, _ in (p.values for p in test_moe.CASES)}
    for a, m in M.IN_MOE:
        _, world, depth = next(x for x in M.MODES if x[0] == m)
        assert (m, world, depth) in cases, m
        assert models.TINY[a] == M.ARCHS[a][:3]


CASES = [(a, m) for a in M.ARCHS for m, _, _ in M.MODES if (a, m) not in M.IN_EQUIVALENCE | M.IN_MOE]
PARAMS = [pytest.param(a, m, id=f"{a}-{m}", marks=([pytest.mark.slow] if M.is_slow(a, m) else [])
                       + ([pytest.mark.extended] if M.is_extended(a, m) else []))
          for a, m in CASES]


def _refuses(rank, world, arch, mode, depth):
    """shard() on the ranks: the ShardingError's text (or a note that it did not raise)."""
    import copy

    import autoshard

    model = models.build(arch)
    try:
        autoshard.shard(copy.deepcopy(model), mode=mode, depth=depth, example_inputs=models.batch(arch))
    except autoshard.ShardingError as e:
        return str(e)
    return "did not refuse"


@pytest.mark.slow
def test_the_report_reads_back_as_planned(cells):
    """What the cells below read from docs/support.md (arch_matrix.reported) is what
    the plans say: status, fallback nodes, a refusal's reason."""
    for (a, m), c in cells.items():
        r = M.reported(a, m)
        assert (r.status, r.fallback_nodes) == (c.status, c.fallback_nodes), (a, m)
        assert r.reason == c.reason, (a, m)


@pytest.mark.parametrize("arch,mode", PARAMS)
def test_arch_mode_equals_dense(arch, mode):
    cell = M.reported(arch, mode)      # the committed report (checked against the plans by the slow tests)
    assert cell.status == M.expected_status(arch, mode), (cell.status, cell.reason)
    _, world, depth = next(x for x in M.MODES if x[0] == mode)
    if cell.status == "refused":        # shard() refuses on every rank alike, naming the node
        msgs = get_pool(world, timeout=600).run(_refuses, arch, mode, depth)
        assert len(set(msgs)) == 1 and "\n  node: %" in msgs[0], msgs[0]
        assert msgs[0].splitlines()[0] in cell.reason, (msgs[0], cell.reason)
        return
    results = get_pool(world, timeout=600).run(models.check, arch, mode, depth, 0, None, 1, True)
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: {r['failures']}"
        assert r["param_bytes"] == r["plan_param_bytes"], f"rank {rank}"
        assert (r["ledger_bytes"], r["ledger_calls"]) == (r["plan_bytes"], r["plan_calls"]), f"rank {rank}"
        assert r["n_local_params"] == r["n_dense_params"], "tied weights must stay one parameter"
        # the run's plan (real weights, this worker's export) is the reported one
        assert r["fallbacks"] == cell.fallback_nodes, f"rank {rank}"


def test_check_lists_fallback_nodes(tmp_path, capsys, monkeypatch):
    """`autoshard check` names each fallback row of a cell that has them (as reported)."""
    cells = {(a, m): M.reported(a, m) for a in M.ARCHS for m, _, _ in M.MODES}
    arch, mode = next(((a, m) for (a, m), c in cells.items() if c.status == "fallbacks" and m == "2d"))
    import transformers

    from autoshard.cli import main

    _, cfg_cls, kw, _ = M.ARCHS[arch]
    cfg = getattr(transformers, cfg_cls)(**kw)
    cfg.architectures = [M.ARCHS[arch][0]]
    cfg.to_json_file(str(tmp_path / "config.json"))
    monkeypatch.setenv("COLUMNS", "250")
    code = main(["check", str(tmp_path / "config.json"), "--world-size", "4", "--mode", mode,
                 "--batch-size", "4", "--seq-len", "8"])
    out = capsys.readouterr().out
    assert code == 1, out[-2000:]
    for name in cells[arch, mode].fallback_nodes:
        assert f"fallback node {name} " in out, name


def test_refused_cell_is_reported_with_its_reason():
    """A refusal is a documented result: the table says refused, the details name node and reason."""
    from autoshard.ir.errors import ShardingError

    class _Node:
        meta: dict = {}

        def format_node(self):
            return "%reshape_1 : call_function[target=aten.reshape](...)"

    cell = M.refused(ShardingError("cannot gather the batch split", node=_Node()))
    text = M.render({("bloom", "2d"): cell})
    assert "**refused**" in text
    assert "refused: ShardingError: cannot gather the batch split (node: %reshape_1" in text


# every architecture at world sizes that divide none of its widths (4 heads, intermediate 128,
# vocabulary 128 at 3 and 6 ranks): padded (autoshard/passes/pad.py, pad_widths) or held whole, exact
UNEVEN = [pytest.param(a, w, id=f"{a}-1d-w{w}", marks=[pytest.mark.extended] + ([pytest.mark.slow] if w == 6 else []))
          for a in M.ARCHS for w in (3, 6)]


@pytest.mark.parametrize("arch,world", UNEVEN)
def test_uneven_world_sizes_equal_dense(arch, world):
    results = get_pool(world, timeout=900).run(models.check, arch, "1d", None, 0, None, 1, True)
    for rank, r in enumerate(results):
        assert r["failures"] == [], f"rank {rank}: {r['failures']}"
        assert r["param_bytes"] == r["plan_param_bytes"], f"rank {rank}"
        assert r["ledger_calls"] == r["plan_calls"] and r["ledger_bytes"] == pytest.approx(r["plan_bytes"], rel=1e-9)
        assert r["n_local_params"] == r["n_dense_params"], "tied weights must stay one parameter"
        assert r["fallbacks"] == [], f"rank {rank}"
