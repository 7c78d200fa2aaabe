"""Kernel objects (autoshard/ir/kernels.py): frozen, serialisable, and the groups they
declare are the ones their collectives use, in every mode's real plans."""

from __future__ import annotations

import dataclasses

import pytest

import tiny_plans as tp
from autoshard.ir.kernels import KERNELS, Kernel, KernelIO, RowLinear
from autoshard.ir.mesh import Mesh
from autoshard.ir.plan import ShardingPlan
from autoshard.ir.spec import ShardSpec

CASES = [("llama", "1d", 4, None), ("gpt2", "2d", 4, None), ("llama", "2.5d", 8, 2), ("gpt2", "3d", 8, None),
         ("bert", "2d", 4, None)]


@pytest.mark.parametrize("name,mode,world,depth", CASES, ids=[f"{n}-{m}-{w}" for n, m, w, _ in CASES])
def test_plan_kernels_round_trip_and_declare_their_groups(name, mode, world, depth):
    plan = tp.plan_for(name, mode, world, depth)
    kernels = [n for n in plan.nodes if n.kernel is not None]
    assert kernels
    for n in kernels:
        k = n.kernel
        assert Kernel.from_dict(k.to_dict()) == k
        assert type(k).__name__ in KERNELS
        groups = set(k.groups())
        assert all(set(g) <= set(plan.mesh.axes) for g in groups)
        # every collective the plan predicts for the kernel runs over a group it declared
        kernel_axes = {c.axes for c in k.comms(_io(n, plan))}
        assert kernel_axes <= groups, (n.name, kernel_axes, groups)
    assert ShardingPlan.from_json(plan.to_json()).nodes == plan.nodes


def _io(n, plan):
    shapes = {p: (1,) * s.ndim for p, s in n.kernel.in_specs}
    return KernelIO(in_shapes=shapes, out_shape=n.local_shape or (1,), mesh=plan.mesh)


def test_kernel_objects_are_frozen():
    k = RowLinear(axes=("tp",), x=(0,), w=(1,), b=None, n_dim=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.axes = ("dp",)


def test_row_linear_comms_follow_the_output_shape():
    k = RowLinear(axes=("tp",), x=(0,), w=(1,), b=None, n_dim=0,
                  in_specs=(((0,), ShardSpec(dims=((), ("tp",)))),), out_spec=ShardSpec(dims=((), ())))
    mesh = Mesh(axes=("tp",), sizes=(4,))
    [c] = k.comms(KernelIO(in_shapes={(0,): (6, 8)}, out_shape=(6, 32), mesh=mesh))
    assert (c.phase, c.kind, c.axes, c.numel) == ("fwd", "all_reduce", ("tp",), 6 * 32)
