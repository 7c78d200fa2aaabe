"""Plan diff (autoshard/planning/plan_diff.py) and ``autoshard diff A.json B.json``."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

import tiny_plans
from autoshard import ShardingPlan
from autoshard.cli import main
from autoshard.planning.plan_diff import counts, diff, table


def _raw(n):
    """What a node decides, read straight off the NodePlan (not through plan_diff)."""
    return (n.kind, n.op, str(n.kernel), str(n.out_spec), tuple(n.local_shape), n.weight,
            tuple((c.phase, c.kind, c.axes) for c in n.comms), n.param_bytes, round(n.comm_bytes), n.fallback)


@pytest.fixture(scope="module")
def one_d_two_d():
    return tiny_plans.plan_for("llama", "1d", 4), tiny_plans.plan_for("llama", "2d", 4)


def test_every_changed_node_is_listed_and_no_other(one_d_two_d):
    a, b = one_d_two_d
    changes = diff(a, b)
    na, nb = {n.name: n for n in a.nodes}, {n.name: n for n in b.nodes}
    want = {name: "changed" for name in na.keys() & nb.keys() if _raw(na[name]) != _raw(nb[name])}
    want.update({name: "removed" for name in na.keys() - nb.keys()})
    want.update({name: "added" for name in nb.keys() - na.keys()})
    got = {c.name: c.status for c in changes if c.what == "node"}
    assert got == want
    assert len(want) > 20 and "added" in want.values()          # 2d adds the batch-split inputs
    # a linear changes kernel-side facts, and the values shown are the plans' own
    lin = next(c for c in changes if c.what == "node" and na.get(c.name) and na[c.name].kind == "linear")
    fields = {f: (x, y) for f, x, y in lin.fields}
    assert fields["out spec"] == (str(na[lin.name].out_spec), str(nb[lin.name].out_spec))
    assert all(x != y for _, x, y in lin.fields)


def test_params_whose_spec_changed_and_the_plan_row(one_d_two_d):
    a, b = one_d_two_d
    changes = diff(a, b)
    want = {p.name for p in a.params if str(p.spec) != str(b.param(p.name).spec)
            or p.local_shape(a.mesh) != b.param(p.name).local_shape(b.mesh) or p.grad_sync != b.param(p.name).grad_sync}
    assert {c.name for c in changes if c.what == "param"} == want and want
    top = changes[0]
    assert top.what == "plan"
    f = {k: (x, y) for k, x, y in top.fields}
    assert f["mode"] == ("1d", "2d") and f["mesh"] == (str(a.mesh), str(b.mesh))
    assert f["param B/rank"] == (a.param_bytes_per_rank, b.param_bytes_per_rank)
    n = counts(changes)
    assert n["nodes changed"] + n["nodes added"] + n["nodes removed"] == sum(c.what == "node" for c in changes)


def test_equal_plans_have_no_diff(one_d_two_d):
    a, _ = one_d_two_d
    assert diff(a, a) == []
    assert diff(a, ShardingPlan.from_json(a.to_json())) == []


def test_one_field_changed_is_one_entry(one_d_two_d):
    a, _ = one_d_two_d
    nodes = list(a.nodes)
    i = next(i for i, n in enumerate(nodes) if n.kind == "linear" and n.kernel is None)
    other = next(n.kernel for n in nodes if n.kind == "linear" and n.kernel is not None)
    nodes[i] = dataclasses.replace(nodes[i], kernel=other)
    dropped = nodes.pop(-1)
    b = dataclasses.replace(a, nodes=tuple(nodes))
    got = [(c.what, c.name, c.status, [f for f, _, _ in c.fields]) for c in diff(a, b)]
    assert ("node", a.nodes[i].name, "changed", ["kernel"]) in got
    assert any(c[1] == dropped.name and c[2] == "removed" for c in got)
    assert all(c[0] != "param" for c in got)
    assert table(a, b).row_count >= 2


def test_cli_diff_lists_every_changed_node(one_d_two_d, tmp_path, capsys):
    a, b = one_d_two_d
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps({"summary": {}, "plan": json.loads(a.to_json())}))   # `autoshard plan --json` form
    pb.write_text(b.to_json())                                                   # ShardingPlan.to_json() form
    assert main(["diff", str(pa), str(pb), "--width", "400"]) == 1
    assert "same as model.layers.0 (1 layer)" in capsys.readouterr().out      # layer 1 folded by default
    assert main(["diff", str(pa), str(pb), "--width", "400", "--all-layers"]) == 1
    out = capsys.readouterr().out
    names = [c.name for c in diff(a, b) if c.what == "node"]
    for name in names:
        assert f" {name} " in out, name
    assert f"nodes changed: {sum(c.status == 'changed' for c in diff(a, b) if c.what == 'node')}" in out
    assert main(["diff", str(pa), str(pa)]) == 0
    assert "the plans are equal" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert main(["diff", str(pa), str(tmp_path / "bad.json")]) == 2
    assert "cannot read a plan" in capsys.readouterr().err


def _span(changes, layer: str, modules: dict) -> list:
    """The changes of one section from the first naming ``layer`` to the last (a node by its
    module, a parameter by its name)."""
    where = [c.name if c.what == "param" else modules.get(c.name, "") for c in changes]
    at = [i for i, m in enumerate(where) if m == layer or m.startswith(layer + ".")]
    return changes[at[0]:at[-1] + 1]


def test_a_layer_whose_changes_repeat_the_layer_before_is_one_row(one_d_two_d):
    a, b = one_d_two_d
    changes = diff(a, b)
    modules = {n.name: n.module for p in (b, a) for n in p.nodes}
    hidden = []
    for what in ("node", "param"):
        sec = [c for c in changes if c.what == what]
        l0, l1 = _span(sec, "model.layers.0", modules), _span(sec, "model.layers.1", modules)

        def plain(c):       # what may differ between two copies of a layer: numbering, the index
            return (re.sub(r"_\d+$", "", c.name).replace("layers.1.", "layers.0."), c.status, c.fields)

        assert [plain(c) for c in l1] == [plain(c) for c in l0] and l1     # the premise, checked here
        hidden += l1
    folded, every = table(a, b, changes), table(a, b, changes, all_layers=True)
    rows = list(zip(*[c._cells for c in folded.columns]))
    assert [(r[1], r[3]) for r in rows if r[0] == "…"] == [("model.layers.1", "same as model.layers.0 (1 layer)")] * 2
    assert every.row_count == sum(len(c.fields) for c in changes)
    assert every.row_count - folded.row_count == sum(len(c.fields) for c in hidden) - 2
    assert not {c.name for c in hidden} & {r[1] for r in rows}
