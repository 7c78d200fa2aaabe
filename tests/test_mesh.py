"""Mesh: rank <-> coordinates, process groups along axes, validation, serialisation."""

from __future__ import annotations

import itertools
import json

import pytest

from autoshard import ConfigError, Mesh

AXES = ("dep", "row", "col")
MESH = Mesh(axes=AXES, sizes=(2, 2, 2))
# a non-cubic mesh catches mixed-up axis sizes that (2, 2, 2) cannot
ODD = Mesh(axes=AXES, sizes=(2, 3, 4))

AXIS_TUPLES = [t for n in range(0, 4) for t in itertools.combinations(AXES, n)]


def _ids(t):
    return "+".join(t) or "none"


def test_coords_rank_of_round_trip_all_ranks():
    seen = set()
    for r in range(MESH.world_size):
        c = MESH.coords(r)
        assert list(c) == list(AXES)
        assert MESH.rank_of(c) == r
        seen.add(tuple(c.values()))
    # every coordinate triple appears exactly once
    assert seen == set(itertools.product(range(2), range(2), range(2)))


def test_first_axis_is_outermost():
    # rank = dep*4 + row*2 + col on (2, 2, 2); dep*12 + row*4 + col on (2, 3, 4)
    assert MESH.coords(5) == {"dep": 1, "row": 0, "col": 1}
    assert MESH.rank_of({"dep": 0, "row": 1, "col": 1}) == 3
    for r in range(ODD.world_size):
        c = ODD.coords(r)
        assert r == c["dep"] * 12 + c["row"] * 4 + c["col"]
        assert 0 <= c["row"] < 3 and 0 <= c["col"] < 4
        assert ODD.rank_of(c) == r


def test_world_size_and_size():
    assert MESH.world_size == 8
    assert ODD.world_size == 24
    assert ODD.size("row") == 3
    assert ODD.size(("row", "col")) == 12
    assert ODD.size(()) == 1


@pytest.mark.parametrize("mesh", [MESH, ODD], ids=["2x2x2", "2x3x4"])
@pytest.mark.parametrize("axes", AXIS_TUPLES, ids=_ids)
def test_group_ranks(mesh, axes):
    for r in range(mesh.world_size):
        g = mesh.group_ranks(axes, r)
        assert len(g) == mesh.size(axes)
        assert r in g
        assert len(set(g)) == len(g)
        base = mesh.coords(r)
        for pos, other in enumerate(g):
            oc = mesh.coords(other)
            # same coordinates off the group's axes ...
            assert all(oc[a] == base[a] for a in AXES if a not in axes)
            # ... and ordered by block index along the axes (first axis most significant)
            assert mesh.index(axes, other) == pos
        # every member computes the same group
        assert all(mesh.group_ranks(axes, o) == g for o in g)


@pytest.mark.parametrize("mesh", [MESH, ODD], ids=["2x2x2", "2x3x4"])
@pytest.mark.parametrize("axes", AXIS_TUPLES, ids=_ids)
def test_all_groups_partition_the_world(mesh, axes):
    groups = mesh.all_groups(axes)
    assert len(groups) == mesh.world_size // mesh.size(axes)
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(mesh.world_size))          # each rank in exactly one group
    for r in range(mesh.world_size):
        assert [g for g in groups if r in g] == [mesh.group_ranks(axes, r)]
    # rank-independent order: recomputing gives the identical list
    assert mesh.all_groups(axes) == groups


def test_index_is_block_index():
    # on (2, 3, 4): index over (row, col) = row*4 + col, over (col, row) = col*3 + row
    for r in range(ODD.world_size):
        c = ODD.coords(r)
        assert ODD.index(("row", "col"), r) == c["row"] * 4 + c["col"]
        assert ODD.index(("col", "row"), r) == c["col"] * 3 + c["row"]
        assert ODD.index(("dep",), r) == c["dep"]


@pytest.mark.parametrize("axes, sizes", [
    (("a", "b"), (2,)),          # lengths differ
    (("a",), (2, 2)),
    (("a", "a"), (2, 2)),        # duplicate names
    (("a",), (0,)),              # sizes < 1
    (("a", "b"), (2, -1)),
], ids=["fewer-sizes", "more-sizes", "duplicate-name", "zero", "negative"])
def test_bad_mesh_raises_config_error(axes, sizes):
    with pytest.raises(ConfigError):
        Mesh(axes=axes, sizes=sizes)


def test_duplicate_name_message_names_axes():
    with pytest.raises(ConfigError, match="repeat"):
        Mesh(axes=("row", "col", "row"), sizes=(2, 2, 2))


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        Mesh(axes=("a",), sizes=(0,))


@pytest.mark.parametrize("mesh", [MESH, ODD, Mesh(axes=("tp",), sizes=(4,))], ids=["2x2x2", "2x3x4", "tp4"])
def test_to_dict_from_dict(mesh):
    d = mesh.to_dict()
    assert d == {"axes": list(mesh.axes), "sizes": list(mesh.sizes)}
    back = Mesh.from_dict(json.loads(json.dumps(d)))
    assert back == mesh
    assert hash(back) == hash(mesh)
    assert isinstance(back.axes, tuple) and isinstance(back.sizes, tuple)


def test_lists_are_normalised_to_tuples():
    m = Mesh(axes=["row", "col"], sizes=[2, 2])
    assert m == Mesh(axes=("row", "col"), sizes=(2, 2))
    hash(m)  # frozen and hashable: usable as a dict key for process groups


def test_str():
    assert str(MESH) == "dep[2] × row[2] × col[2]"
