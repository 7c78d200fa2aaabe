"""The plan picture (autoshard/ir/draw.py): every drawn block is where the plan puts it.

The SVG is parsed with ``xml.etree``; for every drawn weight, the rectangles that
name a rank (``data-ranks``) must cover exactly the elements ``ShardSpec.local``
gives that rank of an arange of the global shape (no element missing, none twice),
sit where their index ranges say inside the weight's frame, and be hatched and
labelled replicated when several ranks hold them.
"""

from __future__ import annotations

import math
import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET

import pytest
import torch

import tiny_plans
from autoshard import Mesh, ShardingPlan, ShardSpec
from autoshard.ir.draw import render_svg
from autoshard.ir.plan import Comm, NodePlan, ParamPlan

NS = {"s": "http://www.w3.org/2000/svg"}

CASES = [("gpt2", "1d", 4, None), ("llama", "1d", 2, None), ("llama", "2d", 4, None), ("gpt2", "2d", 4, None),
         ("gpt2", "2.5d", 8, 2), ("llama", "3d", 8, None)]


def _ids(case):
    return tiny_plans.case_id(case)


def _range(text: str) -> tuple[int, int]:
    a, b = text.split(":")
    return int(a), int(b)


def _expected_names(plan) -> set[str]:
    """Stem/head = no all-digit name component; the block = the first ``<path>.<n>``."""
    def numbered(name):
        return any(p.isdigit() for p in name.split(".")[:-1])

    names = [p.name for p in plan.params if not p.is_buffer]
    first = next(n for n in names if numbered(n))
    parts = first.split(".")
    block = ".".join(parts[:next(i for i, p in enumerate(parts) if p.isdigit()) + 1])
    return {n for n in names if not numbered(n) or n.startswith(block + ".")}


def check_picture(svg: str, plan) -> dict:
    """Every assertion of the picture against the plan; returns counts for the callers."""
    root = ET.fromstring(svg)                                   # valid XML, or this raises
    mesh = plan.mesh
    frames = {r.get("data-param"): r for r in root.iter("{http://www.w3.org/2000/svg}rect")
              if r.get("class") == "matrix"}
    blocks = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("class") == "block"]
    patterns = {p.get("id") for p in root.iter("{http://www.w3.org/2000/svg}pattern")}
    cells = {int(r.get("data-rank")): r.get("fill") for r in root.iter("{http://www.w3.org/2000/svg}rect")
             if r.get("class") == "mesh-cell"}
    assert sorted(cells) == list(range(mesh.world_size)), "the mesh grid shows every rank once"
    texts = " ".join("".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text"))
    for a in mesh.axes:
        assert re.search(rf"(^|\s){re.escape(a)} [→]|← {re.escape(a)}|{re.escape(a)}=\d", texts), a

    assert set(frames) == _expected_names(plan)
    replicated_blocks = 0
    for name, frame in frames.items():
        pp = plan.param(name)
        shape = tuple(pp.global_shape)
        assert frame.get("data-shape") == " ".join(map(str, shape))
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        fx, fy = float(frame.get("x")), float(frame.get("y"))
        sx, sy = float(frame.get("width")) / cols, float(frame.get("height")) / rows
        mine = [b for b in blocks if b.get("data-param") == name]
        covered: dict[int, list[int]] = {r: [] for r in range(mesh.world_size)}
        n_split = math.prod(mesh.size(d) for d in pp.spec.dims if d)
        for b in mine:
            (r0, r1), (c0, c1) = _range(b.get("data-rows")), _range(b.get("data-cols"))
            # the rectangle is where its index ranges say, in the frame's scale
            assert float(b.get("x")) == pytest.approx(fx + c0 * sx, abs=2e-3)
            assert float(b.get("y")) == pytest.approx(fy + r0 * sy, abs=2e-3)
            assert float(b.get("width")) == pytest.approx((c1 - c0) * sx, abs=2e-3)
            assert float(b.get("height")) == pytest.approx((r1 - r0) * sy, abs=2e-3)
            ranks = [int(x) for x in b.get("data-ranks").split()]
            assert len(ranks) == mesh.world_size // n_split, (name, ranks)
            if len(ranks) > 1:
                replicated_blocks += 1
                assert b.get("data-replicated"), (name, ranks)
                fill = re.fullmatch(r"url\(#(.+)\)", b.get("fill"))
                assert fill and fill.group(1) in patterns, (name, b.get("fill"))
            else:
                assert b.get("data-replicated") is None and b.get("fill") == cells[ranks[0]]
            for r in ranks:
                covered[r].extend(i * cols + j for i in range(r0, r1) for j in range(c0, c1))
        index = torch.arange(math.prod(shape)).reshape(shape)
        for r in range(mesh.world_size):
            want = pp.spec.local(index, mesh, r).flatten().tolist()
            assert len(covered[r]) == len(want), (name, r, "area")
            assert sorted(covered[r]) == sorted(want), (name, r, "positions")
    return {"weights": len(frames), "replicated_blocks": replicated_blocks, "texts": texts}


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_blocks_cover_each_ranks_local_slice(case):
    plan = tiny_plans.plan_for(*case)
    got = check_picture(render_svg(plan), plan)
    assert got["weights"] >= 5
    # 1d and 2d replicate norms (and 2.5d its weights over dep): something must be hatched
    assert got["replicated_blocks"] > 0


def test_fused_segments_are_drawn_per_segment():
    plan = tiny_plans.plan_for("gpt2", "1d", 4)
    svg = render_svg(plan)
    root = ET.fromstring(svg)
    name = next(p.name for p in plan.params if p.name.endswith("attn.c_attn.weight") and ".0." in p.name)
    assert plan.param(name).spec.segments == (1, 3)
    group = next(g for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("data-param") == name)
    seg_lines = [e for e in group.iter("{http://www.w3.org/2000/svg}line") if e.get("class") == "segment"]
    assert len(seg_lines) == 2                                      # between q|k and k|v
    labels = [t.text for t in group.iter("{http://www.w3.org/2000/svg}text")]
    assert {"seg 0", "seg 1", "seg 2"} <= set(labels)
    per_rank = {}
    for b in group.iter("{http://www.w3.org/2000/svg}rect"):
        if b.get("class") == "block":
            per_rank.setdefault(b.get("data-ranks"), []).append(_range(b.get("data-cols")))
    # each rank holds one 16-column piece of each 64-column segment
    assert per_rank == {str(r): [(16 * r, 16 * r + 16), (64 + 16 * r, 80 + 16 * r), (128 + 16 * r, 144 + 16 * r)]
                        for r in range(4)}


def test_collectives_of_one_linear_are_listed():
    plan = tiny_plans.plan_for("gpt2", "2.5d", 8, 2)
    texts = check_picture(render_svg(plan), plan)["texts"]
    lin = next(n for n in plan.nodes if n.kind == "linear" and ".h.0." in n.module + ".")
    assert f"collectives of one Linear: {lin.module}" in texts
    for c in lin.comms:
        assert f"{c.phase}  {c.kind.replace('_', '-')} over {','.join(c.axes)}" in texts
    assert "all-gather over col" in texts and "reduce-scatter over row" in texts


def _hand_plan(mesh: Mesh, specs: dict[str, tuple[tuple, ShardSpec]]) -> ShardingPlan:
    params = tuple(ParamPlan(name=n, global_shape=s, spec=sp, grad_sync=()) for n, (s, sp) in specs.items())
    lin = NodePlan(name="linear", op="linear", kind="linear", module="blocks.0.fc", out_spec=None,
                   comms=(Comm(phase="fwd", kind="all_gather", axes=(mesh.axes[-1],), group_size=mesh.sizes[-1],
                               buffer_bytes=1024),))
    return ShardingPlan(model="hand", mode="hand", mesh=mesh, tp_axes=mesh.axes, batch_axes=(), batch_size=1,
                        seq_len=1, nodes=(lin,), params=params)


def _S(*dims, segments=()):
    return ShardSpec(dims=tuple(tuple(d) for d in dims), segments=segments)


@pytest.mark.parametrize("mesh", [
    pytest.param(Mesh(axes=("tp",), sizes=(64,)), id="tp64"),
    pytest.param(Mesh(axes=("row", "col"), sizes=(8, 8)), id="row8-col8"),
    pytest.param(Mesh(axes=("dep", "row", "col"), sizes=(4, 4, 4)), id="dep4-row4-col4"),
])
def test_sixty_four_ranks_stay_exact_and_few_coloured(mesh):
    """At 64 ranks the colour is a coordinate (at most 10 hues, each in two shades), not 64
    colours, and the geometry is as exact as at 4."""
    inner = mesh.axes[-1]
    specs = {
        "embed.weight": ((256, 64), _S([], [inner])),
        "blocks.0.qkv.weight": ((192, 128), _S([inner], mesh.axes[:-1] or [], segments=(3, 1))),
        "blocks.0.fc.weight": ((128, 128), _S(mesh.axes[:1], mesh.axes[1:2] if len(mesh.axes) > 1 else [])),
        "blocks.0.norm.weight": ((128,), _S([])),
        "blocks.1.norm.weight": ((128,), _S([])),
    }
    plan = _hand_plan(mesh, specs)
    svg = render_svg(plan)
    got = check_picture(svg, plan)
    assert got["weights"] == 4                     # blocks.1 is not drawn
    root = ET.fromstring(svg)
    solid = {r.get("fill") for r in root.iter("{http://www.w3.org/2000/svg}rect")
             if r.get("class") in ("block", "mesh-cell") and not r.get("fill").startswith("url(")}
    assert len(solid) <= 20, solid
    assert "coordinate" in got["texts"]


def test_draw_writes_the_file(tmp_path):
    plan = tiny_plans.plan_for("llama", "2d", 4)
    out = plan.draw(tmp_path / "plan.svg")
    text = (tmp_path / "plan.svg").read_text()
    assert out == str(tmp_path / "plan.svg") and text.startswith("<svg")
    check_picture(text, plan)


def test_the_picture_survives_json():
    plan = tiny_plans.plan_for("gpt2", "2d", 4)
    assert render_svg(ShardingPlan.from_json(plan.to_json())) == render_svg(plan)


def test_cli_plan_svg(tmp_path, capsys):
    from autoshard.cli import main

    out = tmp_path / "p.svg"
    assert main(["plan", "llama:tiny", "-w", "2", "-m", "1d", "--no-table", "--svg", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    root = ET.fromstring(out.read_text())
    assert root.get("data-mode") == "1d" and root.get("data-mesh") == "tp[2]"
    assert sum(r.get("class") == "matrix" for r in root.iter("{http://www.w3.org/2000/svg}rect")) >= 9


@pytest.mark.skipif(shutil.which("rsvg-convert") is None, reason="rsvg-convert (librsvg2-bin) is not installed")
def test_renders_to_png(tmp_path):
    """librsvg reads the picture (hatch patterns, rotated text) and writes a PNG of its size."""
    plan = tiny_plans.plan_for("gpt2", "2.5d", 8, 2)
    svg = tmp_path / "p.svg"
    plan.draw(svg)
    png = tmp_path / "p.png"
    subprocess.run(["rsvg-convert", "-o", str(png), str(svg)], check=True, capture_output=True, timeout=120)
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    root = ET.fromstring(svg.read_text())
    assert struct.unpack(">II", head[16:24]) == (int(root.get("width")), int(root.get("height")))


def test_unequal_fused_blocks_are_drawn_at_their_widths():
    """Phi-3's ``qkv_proj`` with fewer kv heads (``widths`` 4 : 1 : 1, 96 rows at 2 ranks):
    the dashed lines sit between q | k and k | v (rows 64 and 80), and each rank's pieces
    are its part of every block, as ``ShardSpec.local`` takes them."""
    mesh = Mesh(axes=("tp",), sizes=(2,))
    spec = ShardSpec(dims=(("tp",), ()), widths=((4, 1, 1), ()))
    plan = _hand_plan(mesh, {"blocks.0.qkv_proj.weight": ((96, 64), spec), "blocks.0.fc.weight": ((64, 64), _S([], []))})
    svg = render_svg(plan)
    check_picture(svg, plan)
    group = next(g for g in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}g")
                 if g.get("data-param") == "blocks.0.qkv_proj.weight")
    ys = sorted(float(e.get("y1")) for e in group.iter("{http://www.w3.org/2000/svg}line") if e.get("class") == "segment")
    top = min(float(b.get("y")) for b in group.iter("{http://www.w3.org/2000/svg}rect") if b.get("class") == "block")
    h = max(float(b.get("y")) + float(b.get("height")) for b in group.iter("{http://www.w3.org/2000/svg}rect")
            if b.get("class") == "block") - top
    assert [round((y - top) / h * 96) for y in ys] == [64, 80], ys
