"""ShardSpec: reversible slicing (local / assemble), shapes, errors, text, serialisation."""

from __future__ import annotations

import json
import math

import pytest
import torch

from autoshard import Mesh, ShardingError, ShardSpec
from autoshard.ir.spec import replicated

M1 = Mesh(axes=("tp",), sizes=(2,))
M1_3 = Mesh(axes=("tp",), sizes=(3,))
M2 = Mesh(axes=("row", "col"), sizes=(2, 3))
M3 = Mesh(axes=("dep", "row", "col"), sizes=(2, 2, 2))
M3_ODD = Mesh(axes=("dep", "row", "col"), sizes=(2, 3, 2))


def S(*dims, segments=(), partial=(), widths=()):
    return ShardSpec(dims=tuple(tuple(d) for d in dims), segments=segments, partial=partial, widths=widths)


# (id, mesh, global shape, spec)
CASES = [
    ("1ax-rows", M1, (4, 6), S(["tp"], [])),
    ("1ax-cols", M1, (4, 6), S([], ["tp"])),
    ("1ax-3way", M1_3, (6, 3), S(["tp"], [])),
    ("1ax-3seg", M1, (12,), S(["tp"], segments=(3,))),
    ("1ax-3seg-2d", M1_3, (5, 18), S([], ["tp"], segments=(1, 3))),
    ("1ax-replicated", M1, (3, 5), S([], [])),
    ("2ax-row-col", M2, (4, 9), S(["row"], ["col"])),
    ("2ax-col-row", M2, (6, 4), S(["col"], ["row"])),
    ("2ax-multi-row-col", M2, (12, 5), S(["row", "col"], [])),
    ("2ax-multi-col-row", M2, (12, 5), S(["col", "row"], [])),
    ("2ax-seg3", M2, (4, 18), S(["row"], ["col"], segments=(1, 3))),
    ("2ax-one-axis-only", M2, (3, 6), S([], ["row"])),
    ("2ax-partial", M2, (4, 2), S(["row"], [], partial=("col",))),
    ("3ax-deprow-col", M3, (8, 6), S(["dep", "row"], ["col"])),
    ("3ax-rowdep-col", M3, (8, 6), S(["row", "dep"], ["col"])),
    ("3ax-3d", M3, (4, 6, 10), S(["dep"], ["row"], ["col"])),
    ("3ax-deprow-seg3", M3_ODD, (12, 12), S(["dep", "row"], ["col"], segments=(1, 3))),
    ("3ax-all-on-one-dim", M3_ODD, (2, 24), S([], ["dep", "row", "col"])),
    ("3ax-seg3-multi", M3, (3, 24), S([], ["dep", "row"], segments=(1, 3))),
    ("3ax-col-unused", M3, (4, 6), S(["dep", "row"], [])),
    # unequal fused blocks (Phi-3's q, k, v with fewer kv heads: 4 : 1 : 1)
    ("1ax-widths", M1, (3, 12), S([], ["tp"], widths=((), (4, 1, 1)))),
    ("2ax-widths", M2, (18, 4), S(["col"], ["row"], widths=((2, 1), ()))),
    ("3ax-widths-multi", M3, (24, 2), S(["dep", "row"], [], widths=((1, 2), ()))),
]


def _ref_local(t: torch.Tensor, spec: ShardSpec, mesh: Mesh, rank: int) -> torch.Tensor:
    """Independent reference: per split dim, cut into ``segments`` blocks, take block
    ``index`` of ``size(axes)`` from each, glue back."""
    out = t
    for d, axes in enumerate(spec.dims):
        if not axes:
            continue
        idx, count = mesh.index(axes, rank), mesh.size(axes)
        w = spec.widths[d] if spec.widths else ()
        segs = out.split([out.shape[d] // sum(w) * x for x in w], dim=d) if w else out.chunk(spec.segments[d], dim=d)
        out = torch.cat([s.chunk(count, dim=d)[idx] for s in segs], dim=d)
    return out


def _rand(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


@pytest.mark.parametrize("mesh, shape, spec", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_assemble_inverts_local(mesh, shape, spec):
    t = _rand(shape, seed=sum(shape))
    blocks = [spec.local(t, mesh, r) for r in range(mesh.world_size)]
    back = spec.assemble(blocks, mesh)
    assert torch.equal(back, t)


@pytest.mark.parametrize("mesh, shape, spec", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_local_matches_reference_and_local_shape(mesh, shape, spec):
    t = _rand(shape, seed=7)
    expect_shape = spec.local_shape(shape, mesh)
    n_split = math.prod(mesh.size(d) for d in spec.dims if d)
    distinct = set()
    for r in range(mesh.world_size):
        blk = spec.local(t, mesh, r)
        assert tuple(blk.shape) == expect_shape
        assert blk.is_contiguous()
        assert torch.equal(blk, _ref_local(t, spec, mesh, r))
        distinct.add(tuple(blk.flatten().tolist()))
    # as many distinct blocks as the split dims have shards (the rest are replicas)
    assert len(distinct) == n_split
    assert math.prod(expect_shape) * n_split == t.numel()


@pytest.mark.parametrize("mesh, shape, spec", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_blocks_are_the_ranges_local_takes(mesh, shape, spec):
    """``blocks`` names exactly the global positions ``local`` copies, in the order it
    copies them: index an arange of the global shape with the ranges and compare."""
    spec = ShardSpec(dims=spec.dims, segments=spec.segments, widths=spec.widths)      # blocks ignore partial sums
    index = torch.arange(math.prod(shape)).reshape(shape)
    for r in range(mesh.world_size):
        ranges = spec.blocks(shape, mesh, r)
        assert len(ranges) == len(shape)
        picked = index
        for d, rs in enumerate(ranges):
            assert all(0 <= a < b <= shape[d] for a, b in rs)
            picked = torch.cat([picked.narrow(d, a, b - a) for a, b in rs], dim=d)
        assert torch.equal(picked, spec.local(index, mesh, r)), (r, ranges)


def test_blocks_merges_adjacent_segments_and_refuses_bad_sizes():
    # one shard per segment: the three segment ranges touch and become one
    one = Mesh(axes=("tp",), sizes=(1,))
    assert S(["tp"], segments=(3,)).blocks((12,), one, 0) == (((0, 12),),)
    assert S(["tp"], segments=(3,)).blocks((12,), M1, 1) == (((2, 4), (6, 8), (10, 12)),)
    with pytest.raises(ShardingError, match="not divisible"):
        S(["tp"], segments=(3,)).blocks((8,), M1, 0)
    with pytest.raises(ShardingError, match="2 dims"):
        S(["tp"], []).blocks((8,), M1, 0)


def test_docstring_segment_example():
    s = S(["tp"], segments=(3,))
    w = torch.arange(12.0)
    assert s.local(w, M1, 1).tolist() == [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]
    assert s.local(w, M1, 0).tolist() == [0.0, 1.0, 4.0, 5.0, 8.0, 9.0]


def test_multi_axis_dim_first_axis_outermost():
    # ("dep", "row") over 4 rows on dep[2] x row[2] x col[2]: block = dep*2 + row
    t = torch.arange(4.0)
    s = S(["dep", "row"])
    for r in range(8):
        c = M3.coords(r)
        assert s.local(t, M3, r).tolist() == [float(c["dep"] * 2 + c["row"])]
    s2 = S(["row", "dep"])
    for r in range(8):
        c = M3.coords(r)
        assert s2.local(t, M3, r).tolist() == [float(c["row"] * 2 + c["dep"])]


@pytest.mark.parametrize("spec", [
    pytest.param(S(["tp"], []), id="dim0"),
    pytest.param(S([], ["tp"]), id="dim1"),
    pytest.param(S(["tp"], [], segments=(2, 1)), id="dim0-seg2"),
    pytest.param(S([], []), id="replicated"),
])
def test_local_is_a_copy(spec):
    """The docstring promises a copy: the block must own exactly its own storage
    (a view would keep the whole global tensor alive on every rank) and writing
    to it must leave the global tensor alone."""
    t = torch.zeros(8, 8)
    blk = spec.local(t, M1, 0)
    assert blk.untyped_storage().nbytes() == blk.numel() * blk.element_size()
    blk += 1
    assert t.sum() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.int64, torch.bool])
def test_assemble_keeps_dtype(dtype):
    t = (torch.arange(24).reshape(4, 6) % 5).to(dtype)
    spec = S(["row"], ["col"])
    back = spec.assemble([spec.local(t, M2, r) for r in range(6)], M2)
    assert back.dtype == dtype and torch.equal(back, t)


@pytest.mark.parametrize("mesh, shape, spec", [
    (M1, (5, 4), S(["tp"], [])),                          # 5 rows over 2
    (M1_3, (4, 4), S([], ["tp"])),                        # 4 cols over 3
    (M1, (9,), S(["tp"], segments=(3,))),                 # 3 segments of 3 over 2
    (M1, (6,), S(["tp"], segments=(4,))),                 # 6 not divisible into 4 segments x 2
    (M3, (6, 4), S(["dep", "row"], [])),                  # 6 over dep x row = 4
], ids=["rows", "cols-3way", "segments", "segments-4", "multi-axis"])
def test_local_not_divisible_raises(mesh, shape, spec):
    with pytest.raises(ShardingError, match="not divisible"):
        spec.local(torch.zeros(shape), mesh, 0)


@pytest.mark.parametrize("dims, partial", [
    ((("tp",), ("tp",)), ()),
    ((("row", "col"), ("col",)), ()),
    ((("row", "row"),), ()),
    ((("row",), ()), ("row",)),
], ids=["two-dims", "multi-axis-dim", "same-dim-twice", "dim-and-partial"])
def test_axis_used_twice_raises(dims, partial):
    with pytest.raises(ShardingError, match="used twice"):
        ShardSpec(dims=dims, partial=partial)


def test_widths_normalise_and_refuse_bad_sizes():
    """Widths are reduced by their gcd; equal ones are plain segments (the same spec, the
    same dict); a block that does not split into the shards is refused, naming the widths."""
    s = S([], ["tp"], widths=((), (64, 16, 16)))
    assert s.widths == ((), (4, 1, 1)) and s.segments == (1, 3) and str(s) == "[R, S(tp)x(4:1:1)]"
    assert S(["tp"], widths=((2, 2, 2),)) == S(["tp"], segments=(3,))
    assert "widths" not in S(["tp"], widths=((2, 2, 2),)).to_dict()
    assert s.with_dim(1, ()).widths == () and s.with_partial(("x",)).widths == s.widths
    assert s.cuts(1, 96, 2) == [(0, 64), (64, 16), (80, 16)]
    with pytest.raises(ShardingError, match=r"widths \(4, 1, 1\)"):
        s.local(torch.zeros(2, 12), Mesh(axes=("tp",), sizes=(4,)), 0)      # k and v blocks of 2 into 4
    with pytest.raises(ShardingError, match="split dim"):
        S([], [], widths=((), (2, 1)))


def test_segments_length_mismatch_raises():
    with pytest.raises(ShardingError):
        ShardSpec(dims=(("tp",), ()), segments=(3,))


def test_default_segments_and_properties():
    s = S(["row"], [], ["col"])
    assert s.segments == (1, 1, 1)
    assert s.ndim == 3
    assert s.axes == ("row", "col")
    assert s.split_dim("col") == 2 and s.split_dim("dep") is None
    assert not s.is_replicated
    assert replicated(2).is_replicated
    assert not S([], [], partial=("tp",)).is_replicated


def test_with_dim_and_with_partial():
    s = replicated(2).with_dim(1, ("tp",), 3)
    assert s == S([], ["tp"], segments=(1, 3))
    assert s.with_dim(1, ()).segments == (1, 1)                # unsplitting resets segments
    assert s.with_partial(("x",)).partial == ("x",)


@pytest.mark.parametrize("spec, text", [
    (replicated(2), "[R, R]"),
    (replicated(0), "[]"),
    (S(["tp"], []), "[S(tp), R]"),
    (S([], ["tp"], segments=(1, 3)), "[R, S(tp)x3]"),
    (S(["dep", "row"], ["col"]), "[S(dep,row), S(col)]"),
    (S(["row"], [], partial=("col",)), "[S(row), R] P(col)"),
    (S([], partial=("dep", "row")), "[R] P(dep,row)"),
], ids=["rep2", "scalar", "rows", "seg3", "multi-axis", "partial", "partial-multi"])
def test_str(spec, text):
    assert str(spec) == text
    assert repr(spec) == text


@pytest.mark.parametrize("spec", [c[3] for c in CASES] + [S(["row"], [], partial=("col",)), replicated(0)],
                         ids=[c[0] for c in CASES] + ["partial", "scalar"])
def test_to_dict_from_dict(spec):
    d = json.loads(json.dumps(spec.to_dict()))
    back = ShardSpec.from_dict(d)
    assert back == spec
    assert hash(back) == hash(spec)
    assert str(back) == str(spec)


@pytest.mark.parametrize("mesh, shape, spec", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_pieces_place_and_owners(mesh, shape, spec):
    """pieces() tile the global tensor exactly once over the owners; place() writes
    each rank's block where local() read it; owner() is the lowest rank with that block."""
    t = _rand(shape, seed=3)
    owners = spec.owners(mesh)
    assert len(owners) == math.prod(mesh.size(d) for d in spec.dims if d)
    hits = torch.zeros(shape, dtype=torch.int64)
    out = torch.full(shape, float("nan"))
    for r in range(mesh.world_size):
        blk = _ref_local(t, spec, mesh, r)
        o = spec.owner(mesh, r)
        assert o <= r and o in owners and torch.equal(_ref_local(t, spec, mesh, o), blk)
        for gidx, lidx in spec.pieces(shape, mesh, r):
            assert torch.equal(t[gidx], blk[lidx])
            if r in owners:
                hits[gidx] += 1
        if r in owners:
            spec.place(out, blk, mesh, r)
    assert bool((hits == 1).all())
    assert torch.equal(out, t)


def test_pieces_merge_adjacent_segments():
    """One split over 1 rank: the segments of the block are adjacent, read as one piece."""
    spec = S(["tp"], segments=(3,))
    assert list(spec.pieces((12,), Mesh(axes=("tp",), sizes=(1,)), 0)) == [((slice(0, 12),), (slice(0, 12),))]
    assert len(list(spec.pieces((12,), M1, 0))) == 3


def test_pieces_wrong_ndim_raises():
    with pytest.raises(ShardingError, match="has 2 dims"):
        list(S(["tp"], []).pieces((4,), M1, 0))


# uneven widths (passes/pad.py, pad_widths): the dense tensor padded with zero units, sliced, assembled, trimmed
UNEVEN = [
    ("8-heads-over-3", M1_3, (128, 96), (144, 96), S(["tp"], []), 1, [3, 3, 2]),            # q_proj, 8 heads of 16
    ("o-proj-in-over-3", M1_3, (96, 128), (96, 144), S([], ["tp"]), 1, [3, 3, 2]),          # o_proj's in features
    ("fused-qkv-12-over-8", Mesh(axes=("tp",), sizes=(8,)), (96, 3 * 96), (96, 3 * 128),
     S([], ["tp"], segments=(1, 3)), 3, [2, 2, 2, 2, 2, 2, 0, 0]),                         # GPT-2 c_attn, 12 heads of 8
]


@pytest.mark.parametrize("mesh, dense, padded, spec, segs, heads", [c[1:] for c in UNEVEN], ids=[c[0] for c in UNEVEN])
def test_uneven_round_trip(mesh, dense, padded, spec, segs, heads):
    """An uneven split round-trips exactly: each rank's block holds ⌈h/t⌉ head slots of
    which its share is real (the rest zeros), and assemble + trim gives the dense tensor."""
    from autoshard.ir.plan import ParamPlan

    pp = ParamPlan(name="w", global_shape=padded, spec=spec, grad_sync=(), dense_shape=dense, pad_segments=segs)
    t = _rand(dense, seed=3)
    blocks = [spec.local(pp.pad(t), mesh, r) for r in range(mesh.world_size)]
    assert torch.equal(pp.trim(spec.assemble(blocks, mesh)), t)
    d = pp.pad_dim
    unit = (dense[d] // segs) // (sum(heads))
    real = [int((b.abs().sum(dim=1 - d) != 0).sum()) // unit // segs for b in blocks]
    assert real == heads
