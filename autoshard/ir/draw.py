"""A picture of a plan: which block of each weight lives on which rank (SVG).

:func:`render_svg` draws, for the stem and head of the model (the parameters
outside any numbered block: embeddings, final norm, LM head) and for its first
repeated block (the first numbered module path, ``transformer.h.0`` or
``model.layers.0``: found from the names, not from class names), every weight as
its global matrix in stored layout (rows × cols, a vector as one row), cut into
the blocks the plan gives each rank. A block held by one rank is filled with
that rank's colour; a block several ranks hold (replicated over some mesh axes)
is hatched with their colours and says over which axes. Fused segments (GPT-2's
``c_attn``: q, k, v; a spec with ``segments`` > 1) are separated by dashed lines.
The mesh is drawn as a grid with its axis names, and one Linear's collectives
(from ``NodePlan.comms``) are listed beside it.

Where each block lies comes from :meth:`ShardSpec.blocks`, the geometry
:meth:`ShardSpec.local` slices with. Every block rectangle carries its numbers
(``data-param``, ``data-ranks``, ``data-rows="a:b"``, ``data-cols="c:d"``,
``data-replicated``), and every matrix frame its ``data-shape``, so a test (or a
script) can check the picture against the plan exactly.

Colours: up to 10 ranks, one colour per rank. Beyond that, the colour is the
coordinate on one mesh axis (the innermost that has at most 10 positions), lighter
on odd coordinates of the next axis; a single long axis (``tp[64]``) repeats 8
colours, lighter on every other run of 8. Blocks are labelled with their ranks (and
coordinates) where the label fits.

    >>> import autoshard, transformers                      # doctest: +SKIP
    >>> cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128)   # doctest: +SKIP
    >>> autoshard.plan(cfg, world_size=4, mode="1d").draw("gpt2-1d.svg")   # doctest: +SKIP

A plan made by hand draws the same way:

    >>> from autoshard.ir.mesh import Mesh
    >>> from autoshard.ir.plan import ParamPlan, ShardingPlan
    >>> from autoshard.ir.spec import ShardSpec
    >>> w = ParamPlan(name="layers.0.proj.weight", global_shape=(8, 4), grad_sync=(),
    ...               spec=ShardSpec(dims=(("tp",), ())))
    >>> plan = ShardingPlan(model="toy", mode="1d", mesh=Mesh(axes=("tp",), sizes=(2,)), tp_axes=("tp",),
    ...                     batch_axes=(), batch_size=1, seq_len=1, nodes=(), params=(w,))
    >>> svg = render_svg(plan)
    >>> svg.count('class="block"'), 'data-rows="4:8"' in svg
    (2, True)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

__all__ = ["render_svg", "draw", "first_block", "drawn_params"]

# Tableau 10: distinct hues that stay apart for colour-blind readers too
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
           "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
MAX_WIDTH = 1200          # panels wrap to the next line past this
SIDE = 180                # the long side of a matrix, in px
MIN_SIDE = 36             # the short side at least this ...
MIN_BLOCK = 11            # ... and every block at least this many px where it can
MAX_SIDE = 1100
VECTOR_H = 16             # a 1-D parameter is drawn as one row this tall
GAP = 18


# --------------------------------------------------------------------------- which weights

_NUM = re.compile(r"^\d+$")


def first_block(names) -> str | None:
    """The module path of the first repeated block among parameter ``names``: the prefix
    up to the first all-digit component of the first name that has one.

    >>> first_block(["wte.weight", "h.0.attn.weight", "h.1.attn.weight"])
    'h.0'
    >>> first_block(["lm_head.weight"]) is None
    True
    """
    for name in names:
        parts = name.split(".")
        for i, p in enumerate(parts[:-1]):
            if _NUM.match(p):
                return ".".join(parts[:i + 1])
    return None


def _has_number(name: str) -> bool:
    return any(_NUM.match(p) for p in name.split(".")[:-1])


def drawn_params(plan) -> tuple[list, str | None, list]:
    """``(stem_and_head, block, block_params)``: the parameters the picture draws.

    ``stem_and_head`` are the parameters with no numbered component in their name
    (or in an alias), in the order the graph first uses their module; ``block`` is
    :func:`first_block` and ``block_params`` the parameters under it."""
    params = [p for p in plan.params if not p.is_buffer]
    block = first_block(n for p in params for n in (p.name, *p.aliases))
    order = {}
    for i, n in enumerate(plan.nodes):
        order.setdefault(n.module, i)

    def first_use(p):
        return min(order.get(n.rsplit(".", 1)[0], len(order)) for n in (p.name, *p.aliases))

    stem = [p for p in params if not any(_has_number(n) for n in (p.name, *p.aliases))]
    stem.sort(key=first_use)
    inner = [p for p in params if block and any(n.startswith(block + ".") for n in (p.name, *p.aliases))]
    return stem, block, inner


# --------------------------------------------------------------------------- colours

def _lighten(colour: str, f: float) -> str:
    """``colour`` mixed with white by ``f``."""
    rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return "#" + "".join(f"{round((c + (1 - c) * f) * 255):02x}" for c in rgb)


class _Colours:
    """Rank → colour, and the words that say what the colour means."""

    CYCLE = 8   # an axis longer than the palette repeats 8 colours, shading every other run of 8

    def __init__(self, mesh):
        self.mesh = mesh
        self.axis = self.shade = None
        if mesh.world_size <= len(PALETTE):
            self.meaning = "colour = rank"
            return
        inner = [a for a, s in zip(mesh.axes, mesh.sizes) if s > 1]
        small = [a for a in inner if mesh.size(a) <= len(PALETTE)]
        self.axis = small[-1] if small else inner[-1]
        if mesh.size(self.axis) > len(PALETTE):
            self.meaning = (f"colour = {self.axis} coordinate mod {self.CYCLE}, "
                            f"lighter where {self.axis} // {self.CYCLE} is odd")
            return
        rest = [a for a in inner if a != self.axis]
        self.shade = rest[-1] if rest else None
        self.meaning = f"colour = {self.axis} coordinate" + (
            f", lighter where {self.shade} is odd" if self.shade else "")

    def of(self, rank: int) -> str:
        if self.axis is None:
            return PALETTE[rank]
        c = self.mesh.coords(rank)
        i = c[self.axis]
        if self.mesh.size(self.axis) > len(PALETTE):
            col, light = PALETTE[i % self.CYCLE], (i // self.CYCLE) % 2
        else:
            col, light = PALETTE[i], self.shade is not None and c[self.shade] % 2
        return _lighten(col, 0.45) if light else col


class _Patterns:
    """One hatch ``<pattern>`` per distinct set of holder colours."""

    def __init__(self):
        self.ids: dict[tuple[str, ...], str] = {}

    def fill(self, colours: tuple[str, ...]) -> str:
        key = tuple(dict.fromkeys(colours))[:8]
        if key not in self.ids:
            self.ids[key] = f"hatch{len(self.ids)}"
        return f"url(#{self.ids[key]})"

    def defs(self) -> list[str]:
        out = []
        for cols, pid in self.ids.items():
            # stripes of each holder's colour with a pale gap: reads as hatched even for one colour
            w = 7 * len(cols)
            parts = [f'<pattern id="{pid}" patternUnits="userSpaceOnUse" width="{w}" height="10" '
                     f'patternTransform="rotate(45)">', f'<rect width="{w}" height="10" fill="#ffffff"/>']
            for i, c in enumerate(cols):
                parts.append(f'<rect x="{7 * i}" width="5" height="10" fill="{c}"/>')
            out.append("".join(parts) + "</pattern>")
        return out


# --------------------------------------------------------------------------- svg helpers

def _tw(text: str, size: float) -> float:
    """Rough width of ``text`` in px (sans-serif averages ~0.6 em per character)."""
    return len(text) * size * 0.6


def _num(v: float) -> str:
    return f"{v:.3f}".rstrip("0").rstrip(".")


def _text(x, y, s, *, size=11, anchor="start", weight=None, fill="#222", halo=False, extra="") -> str:
    a = f'x="{_num(x)}" y="{_num(y)}" font-size="{size}"'
    if anchor != "start":
        a += f' text-anchor="{anchor}"'
    if weight:
        a += f' font-weight="{weight}"'
    if halo:   # a white outline keeps a label readable on any fill
        a += ' stroke="#ffffff" stroke-width="2.5" paint-order="stroke" stroke-linejoin="round"'
    return f'<text {a} fill="{fill}"{extra}>{escape(s)}</text>'


def _rect(x, y, w, h, fill, *, stroke=None, sw=None, attrs: dict | None = None) -> str:
    a = f'x="{_num(x)}" y="{_num(y)}" width="{_num(w)}" height="{_num(h)}" fill="{fill}"'
    if stroke:
        a += f' stroke="{stroke}" stroke-width="{sw or 1}"'
    for k, v in (attrs or {}).items():
        a += f" {k}={quoteattr(str(v))}"
    return f"<rect {a}/>"


def _rank_list(ranks: tuple[int, ...], world: int) -> str:
    if len(ranks) == world and world > 1:
        return "all ranks"
    if len(ranks) <= 4:
        return " ".join(f"r{r}" for r in ranks)
    return f"×{len(ranks)} ranks"


# --------------------------------------------------------------------------- panels

@dataclass
class _Block:
    ranks: tuple[int, ...]
    pieces: list[tuple[int, int, int, int]]     # (row start, row stop, col start, col stop)
    replicated: tuple[str, ...]                  # mesh axes the block is copied over


class _WeightPanel:
    def __init__(self, pp, label: str, plan, colours: _Colours, patterns: _Patterns):
        self.pp, self.label, self.plan = pp, label, plan
        self.colours, self.patterns = colours, patterns
        mesh, spec, shape = plan.mesh, pp.spec, tuple(pp.global_shape)
        self.vector = len(shape) == 1
        self.R, self.C = (1, shape[0]) if self.vector else shape
        groups: dict[tuple, list[int]] = {}
        for r in range(mesh.world_size):
            groups.setdefault(spec.blocks(shape, mesh, r), []).append(r)
        copied = tuple(a for a, s in zip(mesh.axes, mesh.sizes) if s > 1 and a not in spec.axes)
        self.blocks = []
        for ranges, ranks in groups.items():
            rows, cols = (((0, 1),), ranges[0]) if self.vector else ranges
            pieces = [(r0, r1, c0, c1) for r0, r1 in rows for c0, c1 in cols]
            self.blocks.append(_Block(tuple(ranks), pieces, copied if len(ranks) > 1 else ()))
        nb_rows = 1 if self.vector else (spec.segments[0] * mesh.size(spec.dims[0]) if spec.dims[0] else 1)
        d_col = 0 if self.vector else 1
        nb_cols = spec.segments[d_col] * mesh.size(spec.dims[d_col]) if spec.dims[d_col] else 1
        if self.vector:
            self.w, self.h = min(MAX_SIDE, max(140, MIN_BLOCK * nb_cols)), VECTOR_H
        else:
            s = SIDE / max(self.R, self.C)
            self.w = min(MAX_SIDE, max(self.C * s, MIN_SIDE, MIN_BLOCK * nb_cols))
            self.h = min(MAX_SIDE, max(self.R * s, MIN_SIDE, MIN_BLOCK * nb_rows))
        self.seg_dims = [d for d, m in enumerate(spec.segments) if m > 1]
        self.lines = self._lines()
        self.left = 10 + (_tw(str(self.R), 10) + 6 if not self.vector else 0) + (26 if self._seg_on(0) else 0)
        self.top = 8 + 14 * len(self.lines) + 14 + (12 if self._seg_on(1) else 0)
        self.width = max(self.left + self.w + 12, max(_tw(t, s) for t, s, _ in self.lines) + 20)
        self.height = self.top + self.h + 12

    def _seg_on(self, axis: int) -> bool:
        """Whether the segment labels go along rows (axis 0) or cols (axis 1) of the picture."""
        if self.vector:
            return axis == 1 and 0 in self.seg_dims
        return axis in self.seg_dims

    def _lines(self) -> list[tuple[str, float, str | None]]:
        pp, mesh = self.pp, self.plan.mesh
        names = " = ".join((self.label, *pp.aliases))
        shape = "×".join(str(s) for s in pp.global_shape)
        local = "×".join(str(s) for s in pp.local_shape(mesh))
        holders = len(self.blocks[0].ranks)
        if len(self.blocks) == 1 and mesh.world_size > 1:
            note = f"replicated: all {mesh.world_size} ranks hold it whole"
        elif holders > 1:
            note = f"each block on {holders} ranks (replicated over {','.join(self.blocks[0].replicated)})"
        else:
            note = f"{len(self.blocks)} blocks, one per rank"
        return [(names, 11, "bold"), (f"{shape} {'vector' if self.vector else '(rows × cols)'} · {pp.spec}", 10.5, None),
                (f"per rank {local} · {note}", 10.5, None)]

    def render(self, x: float, y: float) -> list[str]:
        pp = self.pp
        out = [f'<g class="weight" data-param={quoteattr(pp.name)}>']
        for i, (t, size, weight) in enumerate(self.lines):
            out.append(_text(x + 8, y + 8 + 12 + 14 * i, t, size=size, weight=weight,
                             fill="#111" if weight else "#444"))
        mx, my = x + self.left, y + self.top
        sx, sy = self.w / self.C, self.h / self.R
        shape = " ".join(str(s) for s in pp.global_shape)
        out.append(_text(mx + self.w, my - 4 - (12 if self._seg_on(1) else 0), str(self.C), size=10,
                         anchor="end", fill="#666"))
        if not self.vector:
            out.append(_text(mx - 4 - (26 if self._seg_on(0) else 0), my + self.h / 2 + 4, str(self.R), size=10,
                             anchor="end", fill="#666"))
        out.append(_rect(mx, my, self.w, self.h, "#f4f4f4",
                         attrs={"class": "matrix", "data-param": pp.name, "data-shape": shape,
                                "data-spec": str(pp.spec)}))
        world = self.plan.mesh.world_size
        for b in self.blocks:
            if len(b.ranks) == 1:
                fill = self.colours.of(b.ranks[0])
            else:
                fill = self.patterns.fill(tuple(self.colours.of(r) for r in b.ranks))
            for r0, r1, c0, c1 in b.pieces:
                bx, by, bw, bh = mx + c0 * sx, my + r0 * sy, (c1 - c0) * sx, (r1 - r0) * sy
                attrs = {"class": "block", "data-param": pp.name, "data-ranks": " ".join(map(str, b.ranks)),
                         "data-rows": f"{r0}:{r1}", "data-cols": f"{c0}:{c1}"}
                if b.replicated or len(b.ranks) > 1:
                    attrs["data-replicated"] = ",".join(b.replicated) or "all"
                thin = min(bw, bh) < 6
                out.append(_rect(bx, by, bw, bh, fill, stroke=None if thin else "#ffffff",
                                 sw=None if thin else 0.8, attrs=attrs))
                out.extend(self._label(b, bx, by, bw, bh, world))
        out.extend(self._segments(mx, my, sx, sy))
        out.append(_rect(mx, my, self.w, self.h, "none", stroke="#333", sw=1))
        out.append("</g>")
        return out

    def _label(self, b: _Block, x, y, w, h, world) -> list[str]:
        mesh = self.plan.mesh
        if len(b.ranks) == 1:
            c = mesh.coords(b.ranks[0])
            options = [f"r{b.ranks[0]}"]
            if world > len(PALETTE) and len(mesh.axes) > 1:
                options.insert(0, f"r{b.ranks[0]} (" + ",".join(str(c[a]) for a in mesh.axes) + ")")
        else:
            options = [_rank_list(b.ranks, world), f"×{len(b.ranks)}"]
            if len(b.ranks) == world:
                options.insert(0, "replicated")
        for t in options:
            for size in (10, 8):
                if _tw(t, size) + 3 <= w and size + 2 <= h:
                    return [_text(x + w / 2, y + h / 2 + size * 0.35, t, size=size, anchor="middle",
                                  halo=True, fill="#111")]
                if _tw(t, size) + 3 <= h and size + 2 <= w:     # a tall narrow block: read it upward
                    cx, cy = x + w / 2 + size * 0.35, y + h / 2
                    return [_text(cx, cy, t, size=size, anchor="middle", halo=True, fill="#111",
                                  extra=f' transform="rotate(-90 {_num(cx)} {_num(cy)})"')]
        return []

    def _segments(self, mx, my, sx, sy) -> list[str]:
        """Dashed lines between fused segments, and their names."""
        out = []
        spec = self.pp.spec
        for d in self.seg_dims:
            m, w = spec.segments[d], spec.block_widths(d)     # unequal blocks (Phi-3's q, k, v) at their widths
            size = self.pp.global_shape[d]
            along_cols = self.vector or d == 1
            for s in range(m):
                lo, hi = sum(w[:s]) * size // sum(w), sum(w[:s + 1]) * size // sum(w)
                if along_cols:
                    if s:
                        out.append(f'<line x1="{_num(mx + lo * sx)}" y1="{_num(my - 3)}" x2="{_num(mx + lo * sx)}" '
                                   f'y2="{_num(my + self.h + 3)}" stroke="#111" stroke-width="1.6" '
                                   f'stroke-dasharray="4 2" class="segment"/>')
                    out.append(_text(mx + (lo + hi) / 2 * sx, my - 4, f"seg {s}", size=9, anchor="middle",
                                     fill="#333"))
                else:
                    if s:
                        out.append(f'<line x1="{_num(mx - 3)}" y1="{_num(my + lo * sy)}" x2="{_num(mx + self.w + 3)}" '
                                   f'y2="{_num(my + lo * sy)}" stroke="#111" stroke-width="1.6" '
                                   f'stroke-dasharray="4 2" class="segment"/>')
                    out.append(_text(mx - 4, my + (lo + hi) / 2 * sy + 3, f"seg {s}", size=9, anchor="end",
                                     fill="#333"))
        return out


class _ModulePanel:
    """The parameters of one module (weight, bias, ...) stacked under its name."""

    def __init__(self, title: str, weights: list[_WeightPanel]):
        self.title, self.weights = title, weights
        self.width = max(max(w.width for w in weights), _tw(title, 12.5) + 20)
        self.height = 22 + sum(w.height for w in weights)

    def render(self, x, y) -> list[str]:
        out = [f'<g class="module" data-module={quoteattr(self.title)}>',
               _text(x + 8, y + 18, self.title, size=12.5, weight="bold", fill="#111")]
        y += 20
        for w in self.weights:
            out.extend(w.render(x, y))
            y += w.height
        out.append("</g>")
        return out


class _MeshPanel:
    """The mesh as grids: the last two axes are rows × cols, outer axes give one grid each."""

    WRAP = 32   # a single axis longer than this is wrapped into rows

    def __init__(self, mesh, colours: _Colours):
        self.mesh, self.colours = mesh, colours
        axes, sizes = mesh.axes, mesh.sizes
        if len(axes) == 1:
            self.row_axis, self.col_axis, self.outer = None, axes[0], ()
            self.nr, self.nc = math.ceil(sizes[0] / self.WRAP), min(sizes[0], self.WRAP)
        else:
            self.row_axis, self.col_axis, self.outer = axes[-2], axes[-1], axes[:-2]
            self.nr, self.nc = sizes[-2], sizes[-1]
        self.cell = max(12.0, min(34.0, 640 / max(self.nc, self.nr)))
        self.n_outer = math.prod(mesh.size(a) for a in self.outer) if self.outer else 1
        self.gw = self.nc * self.cell + 34
        self.gh = self.nr * self.cell + 34 + 8 + (14 if self.outer else 0)
        per_line = max(1, int((560) // self.gw))
        self.cols = min(self.n_outer, per_line)
        self.rows = math.ceil(self.n_outer / self.cols)
        self.title = f"mesh {mesh} · {mesh.world_size} ranks"
        self.width = max(self.cols * self.gw + 16, _tw(self.title, 12) + 20, _tw(colours.meaning, 10.5) + 20)
        self.height = 40 + self.rows * self.gh + 6

    def render(self, x, y) -> list[str]:
        mesh = self.mesh
        out = ['<g class="mesh">', _text(x + 8, y + 20, self.title, size=12, weight="bold"),
               _text(x + 8, y + 34, self.colours.meaning, size=10.5, fill="#444")]
        for k in range(self.n_outer):
            gx = x + 8 + (k % self.cols) * self.gw
            gy = y + 40 + (k // self.cols) * self.gh
            outer = {}
            rem = k
            for a in reversed(self.outer):
                outer[a] = rem % mesh.size(a)
                rem //= mesh.size(a)
            if self.outer:
                out.append(_text(gx + 26, gy + 11, " ".join(f"{a}={outer[a]}" for a in self.outer), size=10.5,
                                 weight="bold", fill="#333"))
                gy += 14
            ox, oy = gx + 26, gy + 24
            mid = oy + self.nr * self.cell / 2
            out.append(_text(ox, gy + 9, f"{self.col_axis} →", size=10, fill="#333"))
            if self.row_axis:   # rotated to read upward: the arrow, first, ends up pointing down
                out.append(_text(gx + 9, mid, f"← {self.row_axis}", size=10, fill="#333", anchor="middle",
                                 extra=f' transform="rotate(-90 {_num(gx + 9)} {_num(mid)})"'))
            if self.cell >= 14:     # coordinates along each axis
                for j in range(self.nc):
                    out.append(_text(ox + j * self.cell + (self.cell - 1) / 2, oy - 3, str(j), size=8,
                                     anchor="middle", fill="#777"))
                for i in range(self.nr if self.row_axis else 0):
                    out.append(_text(ox - 3, oy + i * self.cell + self.cell / 2 + 3, str(i), size=8,
                                     anchor="end", fill="#777"))
            for i in range(self.nr):
                for j in range(self.nc):
                    if self.row_axis is None:
                        if i * self.WRAP + j >= mesh.world_size:
                            continue
                        rank = i * self.WRAP + j
                    else:
                        rank = mesh.rank_of({**outer, self.row_axis: i, self.col_axis: j})
                    cx, cy = ox + j * self.cell, oy + i * self.cell
                    out.append(_rect(cx, cy, self.cell - 1, self.cell - 1, self.colours.of(rank),
                                     attrs={"class": "mesh-cell", "data-rank": rank}))
                    if self.cell >= 14:
                        out.append(_text(cx + (self.cell - 1) / 2, cy + self.cell / 2 + 3, str(rank),
                                         size=9 if self.cell < 22 else 10, anchor="middle", halo=True, fill="#111"))
        out.append("</g>")
        return out


class _LegendPanel:
    def __init__(self, patterns: _Patterns, colours: _Colours, mesh):
        self.sample = patterns.fill((colours.of(0), colours.of(mesh.world_size - 1)))
        self.rows = [("swatch", "a block held by one rank: that rank's colour"),
                     ("hatch", "hatched: a block several ranks hold (replicated over the mesh axes named)"),
                     ("segment", "dashed: the border of a fused segment (each segment split on its own)"),
                     ("frame", "each weight is its global matrix as stored, rows × cols, scaled to fit")]
        self.width = max(_tw(t, 10.5) for _, t in self.rows) + 56
        self.height = 30 + 20 * len(self.rows)
        self.colours = colours

    def render(self, x, y) -> list[str]:
        out = ['<g class="legend">', _text(x + 8, y + 20, "how to read it", size=12, weight="bold")]
        for i, (kind, t) in enumerate(self.rows):
            sy = y + 30 + 20 * i
            if kind == "swatch":
                out.append(_rect(x + 8, sy, 28, 14, self.colours.of(0)))
            elif kind == "hatch":
                out.append(_rect(x + 8, sy, 28, 14, self.sample))
            elif kind == "segment":
                out.append(_rect(x + 8, sy, 28, 14, "#f4f4f4", stroke="#333"))
                out.append(f'<line x1="{_num(x + 22)}" y1="{_num(sy - 2)}" x2="{_num(x + 22)}" y2="{_num(sy + 16)}" '
                           f'stroke="#111" stroke-width="1.6" stroke-dasharray="4 2"/>')
            else:
                out.append(_rect(x + 8, sy, 28, 14, "#f4f4f4", stroke="#333"))
            out.append(_text(x + 44, sy + 11, t, size=10.5, fill="#333"))
        out.append("</g>")
        return out


class _Stack:
    """Panels one under the other."""

    def __init__(self, panels):
        self.panels = panels
        self.width = max(p.width for p in panels)
        self.height = sum(p.height for p in panels) + 6 * (len(panels) - 1)

    def render(self, x, y) -> list[str]:
        out = []
        for p in self.panels:
            out.extend(p.render(x, y))
            y += p.height + 6
        return out


def _pick_linear(plan, block: str | None):
    """The Linear whose collectives are shown: in the first block if any, the one with the
    most collectives (first in graph order on a tie)."""
    linears = [n for n in plan.nodes if n.kind == "linear"]
    inside = [n for n in linears if block and (n.module == block or n.module.startswith(block + "."))]
    pool = inside or linears
    if not pool:
        return None
    return max(pool, key=lambda n: (len(n.comms), -pool.index(n)))


class _CommPanel:
    def __init__(self, plan, node):
        self.plan, self.node = plan, node
        mesh = plan.mesh
        lines = [(f"collectives of one Linear: {node.module or node.name}", 12, "bold"),
                 (f"node {node.name}" + (f" · kernel {node.kernel}" if node.kernel else "")
                  + f" · weight {node.weight or '-'}", 10.5, None),
                 (f"output spec {node.out_spec}", 10.5, None)]
        if not node.comms:
            lines.append(("no collective in forward or backward", 10.5, None))
        for c in node.comms:
            others = [f"r{r}" for r in mesh.group_ranks(tuple(c.axes), 0) if r != 0]
            if len(others) > 8:
                others = [*others[:3], "…", *others[-2:]]
            lines.append((f"{c.phase}  {c.kind.replace('_', '-')} over {','.join(c.axes)}  ·  group of "
                          f"{c.group_size} (rank 0 with {' '.join(others) or 'itself'})"
                          f"  ·  {c.bytes_per_rank:,.0f} B/rank", 10.5, None))
        self.lines = lines
        self.width = max(_tw(t, s) for t, s, _ in lines) + 20
        self.height = 12 + 15 * len(lines) + 8

    def render(self, x, y) -> list[str]:
        out = ['<g class="comms">']
        for i, (t, size, weight) in enumerate(self.lines):
            out.append(_text(x + 8, y + 20 + 15 * i, t, size=size, weight=weight,
                             fill="#111" if weight else "#333"))
        out.append("</g>")
        return out


def _flow(panels, y: float, width: float = MAX_WIDTH) -> tuple[list[tuple[float, float]], float]:
    """Left-to-right placement, wrapping at ``width``; returns positions and the bottom."""
    pos, x, line_h = [], 0.0, 0.0
    for p in panels:
        if x > 0 and x + p.width > width:
            y += line_h + GAP
            x, line_h = 0.0, 0.0
        pos.append((x + 10, y))
        x += p.width + GAP
        line_h = max(line_h, p.height)
    return pos, y + line_h


def _count_blocks(names, block: str) -> int:
    """How many numbered blocks sit beside ``block`` (``h.0``, ``h.1``, ... under ``h``)."""
    container, depth = block.rsplit(".", 1)[0] if "." in block else "", block.count(".")
    found = set()
    for n in names:
        parts = n.split(".")
        if ".".join(parts[:depth]) == container and len(parts) > depth and _NUM.match(parts[depth]):
            found.add(parts[depth])
    return len(found)


def _short(name: str, block: str | None) -> str:
    return name[len(block) + 1:] if block and name.startswith(block + ".") else name


def render_svg(plan) -> str:
    """The picture of ``plan`` as an SVG document (a string); see the module docstring."""
    mesh = plan.mesh
    colours, patterns = _Colours(mesh), _Patterns()
    stem, block, inner = drawn_params(plan)

    def panels(params):
        by_module: dict[str, list] = {}
        for p in params:
            if len(p.global_shape) in (1, 2):
                by_module.setdefault(p.name.rsplit(".", 1)[0] if "." in p.name else "", []).append(p)
        return [_ModulePanel(_short(m, block) or "(top level)",
                             [_WeightPanel(p, p.name[len(m) + 1:] if m else p.name, plan, colours, patterns)
                              for p in ps])
                for m, ps in by_module.items()]

    stem_panels, block_panels = panels(stem), panels(inner)
    skipped = [p.name for p in (*stem, *inner) if len(p.global_shape) not in (1, 2)]
    linear = _pick_linear(plan, block)
    side = [_LegendPanel(patterns, colours, mesh), *([_CommPanel(plan, linear)] if linear is not None else [])]
    top = [_MeshPanel(mesh, colours), _Stack(side)]

    body: list[str] = []
    title = f"autoshard plan · {plan.model} · {plan.mode} · mesh {mesh}"
    s = plan.summary()
    sub = (f"per rank: parameters {s['param_bytes_per_rank']:,} B · comm per step fwd "
           f"{s['comm_bytes_per_rank_fwd']:,.0f} B, bwd {s['comm_bytes_per_rank_bwd']:,.0f} B · "
           f"batch {plan.batch_size} × seq {plan.seq_len}" + (f" · dp {plan.dp}" if plan.dp > 1 else ""))
    body.append(_text(18, 26, title, size=16, weight="bold", fill="#111"))
    body.append(_text(18, 44, sub, size=11, fill="#444"))
    widths = [_tw(title, 16) + 36, _tw(sub, 11) + 36]
    y = 58.0
    pos, bottom = _flow(top, y)
    for p, (px, py) in zip(top, pos):
        body.extend(p.render(px, py))
    widths += [px + p.width for p, (px, _) in zip(top, pos)]
    y = bottom + 14
    n_blocks = _count_blocks([n for p in plan.params for n in (p.name, *p.aliases)], block) if block else 0
    sections = [("stem and head: the weights outside the numbered blocks", stem_panels)]
    if block:
        sections.append((f"first repeated block: {block} (of {n_blocks} under {block.rsplit('.', 1)[0]})",
                         block_panels))
    for heading, ps in sections:
        if not ps:
            continue
        y += 10
        body.append(f'<line x1="10" y1="{_num(y)}" x2="{MAX_WIDTH}" y2="{_num(y)}" stroke="#ccc"/>')
        body.append(_text(18, y + 22, heading, size=14, weight="bold", fill="#111"))
        pos, bottom = _flow(ps, y + 32)
        for p, (px, py) in zip(ps, pos):
            body.extend(p.render(px, py))
        widths += [px + p.width for p, (px, _) in zip(ps, pos)]
        y = bottom + 10
    if skipped:
        note = "not drawn (not 1-D or 2-D): " + ", ".join(skipped)
        body.append(_text(18, y + 16, note, size=10.5, fill="#666"))
        widths.append(_tw(note, 10.5) + 36)
        y += 24
    width, height = math.ceil(max(widths) + 10), math.ceil(y + 12)
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="{FONT}" data-model={quoteattr(plan.model)} '
            f'data-mode={quoteattr(plan.mode)} data-mesh={quoteattr(str(mesh))}>',
            f"<title>{escape(title)}</title>", "<defs>", *patterns.defs(), "</defs>",
            f'<rect width="{width}" height="{height}" fill="#ffffff"/>']
    return "\n".join([*head, *body, "</svg>"]) + "\n"


def draw(plan, path) -> str:
    """Write :func:`render_svg` of ``plan`` to ``path`` (an ``.svg`` file); returns the path."""
    path = str(path)
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_svg(plan))
    return path
