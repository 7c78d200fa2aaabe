"""The plan table folds runs of repeated layers (autoshard/ir/plan_table.py): a stamped
7-layer tiny Llama shows layer 0 and one "same as" row; a layer that differs in any
column is shown in full; ``all_layers=True`` (``--all-layers``) shows every row."""

from __future__ import annotations

import dataclasses
import re

import pytest
import transformers

import autoshard
from autoshard.ir.plan_table import Folded, fold, layer_of

# the dims of tests/planning/test_search_pricing.py's Llama: the session's disk cache holds
# one 3-layer export for both (stamped to 6 there, 7 here)
LLAMA7 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=7, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64)


@pytest.fixture(scope="module")
def plan7():
    return autoshard.plan(transformers.LlamaConfig(**LLAMA7), world_size=2, mode="1d", batch_size=2, seq_len=16)


def _rows(table) -> list[tuple]:
    cols = [list(c._cells) for c in table.columns]
    return list(zip(*cols))


def _layer(row) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", row[2] + ".")
    return int(m.group(1)) if m else None


def _by_layer(rows) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(_layer(r), []).append(r)
    return out


def _abstract(rows, i) -> list[tuple]:
    """A layer's rows without what may differ between copies: the node name's numbering
    and the layer index in the module path."""
    return [(re.sub(r"_\d+$", "", r[0]), r[1], r[2].replace(f"model.layers.{i}.", "model.layers.#."), *r[3:])
            for r in rows]


def _edit(plan, layer: int, **change):
    """``plan`` with the first Linear of ``layer`` changed (a note, a kernel, ...)."""
    nodes = list(plan.nodes)
    k = next(j for j, n in enumerate(nodes) if n.kind == "linear" and n.module.startswith(f"model.layers.{layer}."))
    nodes[k] = dataclasses.replace(nodes[k], **{f: fn(nodes[k]) for f, fn in change.items()})
    return dataclasses.replace(plan, nodes=tuple(nodes))


def test_seven_identical_layers_fold_into_one_row(plan7):
    full = _rows(plan7.table(all_layers=True))
    layers = _by_layer(full)
    assert sorted(k for k in layers if k is not None) == list(range(7))
    # the premise, checked here independently: every layer is layer 0 up to numbering
    assert all(_abstract(layers[i], i) == _abstract(layers[0], 0) for i in range(1, 7))
    shown = _rows(plan7.table())
    fold_rows = [r for r in shown if r[0] == "…"]
    assert len(fold_rows) == 1
    assert fold_rows[0][2] == "model.layers.1 … model.layers.6" and fold_rows[0][-1] == "same as model.layers.0 (6 layers)"
    # everything else is the full table's rows of the stem, layer 0 and the head, in order
    assert [r for r in shown if r[0] != "…"] == [r for r in full if _layer(r) in (None, 0)]
    assert len(shown) == len(full) - 6 * len(layers[0]) + 1
    i = shown.index(fold_rows[0])
    assert _layer(shown[i - 1]) == 0 and _layer(shown[i + 1]) is None      # right after layer 0


def test_a_layer_that_differs_is_shown_in_full(plan7):
    odd = _edit(plan7, 3, notes=lambda n: n.notes + ("odd one out",))
    shown = _rows(odd.table())
    assert [(r[2], r[-1]) for r in shown if r[0] == "…"] == [
        ("model.layers.1 … model.layers.2", "same as model.layers.0 (2 layers)"),
        ("model.layers.4 … model.layers.6", "same as model.layers.0 (3 layers)")]
    layers = _by_layer(shown)
    assert set(layers) == {None, 0, 3} and len(layers[3]) == len(layers[0])
    assert any("odd one out" in r[-1] for r in layers[3])
    # the last layer with another collective: first layer, one row, last layer
    assert next(n for n in plan7.nodes if n.kind == "linear" and n.module.startswith("model.layers.6.")).comms
    last = _edit(plan7, 6, comms=lambda n: ())
    shown = _rows(last.table())
    assert [(r[2], r[-1]) for r in shown if r[0] == "…"] == [
        ("model.layers.1 … model.layers.5", "same as model.layers.0 (5 layers)")]
    assert set(_by_layer(shown)) == {None, 0, 6}


def test_all_layers_and_all_nodes_compose(plan7):
    annotated = [n for n in plan7.nodes if n.kind != "other" or n.fallback or n.kernel is not None]
    assert plan7.table(all_layers=True).row_count == len(annotated)
    assert plan7.table(all_layers=True, all_nodes=True).row_count == len(plan7.nodes)
    every = _rows(plan7.table(all_nodes=True))
    assert [r[2] for r in every if r[0] == "…"] == ["model.layers.1 … model.layers.6"]
    assert len(every) < len(plan7.nodes) / 3


def _covered(out, modules) -> list[int]:
    """The row indices ``fold``'s output stands for, in order (a folded layer: its rows)."""
    got = []
    for x in out:
        if isinstance(x, Folded):
            got += [i for i, m in enumerate(modules) if layer_of(m) and layer_of(m)[0] == x.prefix
                    and x.first <= layer_of(m)[1] <= x.last]
        else:
            got.append(x)
    return got


def test_fold_abstracts_numbering_and_keeps_every_row_once():
    names = {"a", "a_1", "a_2", "a_3", "b", "b_1", "y", "y_1"}
    # a note naming a node of its own layer, and a path one layer up: the same up to numbering
    rows = [("a", "s.0.f", "from a"), ("a_1", "s.1.f", "from a_1, s.0.f"), ("a_2", "s.2.f", "from a_2, s.1.f")]
    out = fold([r[1] for r in rows], rows, names)
    assert out[:2] == [0, 1] and out[2] == Folded("s", 1, 2, 2)
    # a row of no layer (a node a pass added) inside a layer is part of it, compared with the rest
    rows = [("a", "s.0.f", ""), ("b", "", ""), ("a_1", "s.0.g", ""),
            ("a_2", "s.1.f", ""), ("b_1", "", ""), ("a_3", "s.1.g", "")]
    assert fold([r[1] for r in rows], rows, names) == [0, 1, 2, Folded("s", 0, 1, 1)]
    rows[4] = ("b_1", "", "other")
    assert fold([r[1] for r in rows], rows, names) == [0, 1, 2, 3, 4, 5]
    # two stacks interleaved: no layer is a run of its own rows, nothing folds
    rows = [("a", "s.0.f", ""), ("y", "t.0.g", ""), ("a_1", "s.0.f", ""), ("y_1", "t.0.g", ""),
            ("a_2", "s.1.f", ""), ("b", "t.1.g", ""), ("a_3", "s.1.f", ""), ("b_1", "t.1.g", "")]
    assert fold([r[1] for r in rows], rows, names) == list(range(8))
    rows = [("a", "s.0.f", ""), ("y", "t.5.g", ""), ("a_1", "s.0.f", ""),
            ("a_2", "s.1.f", ""), ("y_1", "t.5.g", ""), ("a_3", "s.1.f", "")]
    assert fold([r[1] for r in rows], rows, names) == list(range(6))
    # whatever folds, every row is shown or folded exactly once, in order
    for rows in ([("a", "s.0.f", ""), ("a_1", "s.1.f", ""), ("x", "u", ""), ("a_2", "s.2.f", ""), ("a_3", "s.3.f", "")],
                 [("a", "s.0.f", ""), ("a_1", "s.1.f", "n"), ("a_2", "s.2.f", ""), ("a_3", "s.3.f", "")]):
        modules = [r[1] for r in rows]
        assert _covered(fold(modules, rows, names), modules) == list(range(len(rows)))
    # the outermost integer is the layer: an expert index inside a layer stays part of it
    assert layer_of("model.layers.3.mlp.experts.7.w1") == ("model.layers", 3)
    assert layer_of("encoder.block.0.layer.1.DenseReluDense") == ("encoder.block", 0)


def test_cli_folds_by_default_and_all_layers_lists_every_layer(plan7, tmp_path, capsys, monkeypatch):
    import json

    import autoshard.cli.plan as cli_plan
    from autoshard.cli import main

    # the command's own flags and printing, on the module's plan (planning it again is tested above)
    monkeypatch.setattr(cli_plan, "_plan_or_search", lambda args, cluster: (plan7, None))
    out = tmp_path / "plan.json"
    args = ["plan", "llama:tiny", "-w", "2", "-m", "1d", "-b", "2", "-s", "16", "--width", "400"]
    assert main(args + ["--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "same as model.layers.0 (6 layers)" in text and "model.layers.6." not in text
    assert len(json.loads(out.read_text())["plan"]["nodes"]) == len(plan7.nodes)      # --json keeps every node
    assert main(args + ["--all-layers", "--all-nodes"]) == 0
    text = capsys.readouterr().out
    assert "same as model.layers" not in text and "model.layers.6." in text
    assert all(f" {n.name} " in text for n in plan7.nodes)                             # every node, every layer
