"""Compile once per host (autoshard.launch.compile_share).

A plan's compiled graphs are one program on every rank (group aliases, the rank read
from a graph op): dynamo's graph, AOTAutograd's forward and backward compare equal
across ranks. :class:`HostShared` lets the host's lowest rank compile first and the
others follow; a rank whose graph differs does not wait. (The inductor cache hits
themselves: ``tests/test_compile.py::test_compiled_equals_eager``.)
"""

from __future__ import annotations

import difflib
import time

import pytest

import models
from dist_pool import get_pool


def _graphs(rank, world, name, mode):
    sharded, inputs = models.compile_setup(name, mode)
    codes = {}
    sharded(**inputs).loss.backward()                    # the first call runs eagerly (self-check)
    sharded.compile(backend=models.aot_recorder(codes))
    sharded(**inputs).loss.backward()
    return codes


@pytest.mark.parametrize("case", [("llama", "1d", 2), pytest.param(("gpt2", "2d", 4), marks=pytest.mark.slow)],
                         ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}")
def test_every_rank_compiles_one_program(case):
    name, mode, world = case
    res = get_pool(world, timeout=900).run(_graphs, name, mode)
    assert set(res[0]) == {"dynamo", "forward", "backward"}
    assert "autoshard/" in res[0]["dynamo"], "the collectives name their group by its alias"
    for rank in range(1, world):
        for what, code in res[0].items():
            diff = [d for d in difflib.unified_diff(code.splitlines(), res[rank][what].splitlines(), lineterm="", n=0)
                    if d[:1] in "+-" and d[:3] not in ("+++", "---")]
            assert not diff, f"rank {rank}'s {what} graph differs from rank 0's:\n" + "\n".join(diff[:10])


def _follow(rank, world, lead_s, differ):
    import torch
    import torch.distributed as dist
    from torch import fx

    from autoshard.launch.compile_share import HostShared

    calls = []

    def inner(gm, example_inputs):
        calls.append(("start", time.monotonic()))
        if rank == 0:
            time.sleep(lead_s)
        calls.append(("end", time.monotonic()))
        return gm.forward

    def graph(scale):
        g = fx.Graph()
        x = g.placeholder("x")
        g.output(g.call_function(torch.mul, (x, scale)))
        return fx.GraphModule(torch.nn.Module(), g)

    backend = HostShared(inner, share=True)
    dist.barrier()
    t0 = time.monotonic()
    fn = backend(graph(2.0 if rank == 0 or not differ else 3.0), [torch.ones(3)])
    out = fn(torch.ones(3))
    dist.barrier()
    return {"start": calls[0][1] - t0, "end": calls[1][1] - t0, "out": out.tolist(),
            "shared": backend.shared, "alone": backend.alone}


def test_the_lowest_rank_compiles_first_and_the_others_follow():
    lead = 1.0
    res = get_pool(2, timeout=300).run(_follow, lead, False)
    assert res[0]["alone"] == 1 and res[1]["shared"] == 1
    assert res[1]["start"] >= res[0]["end"] - 0.05, res        # rank 1 compiled after rank 0 finished
    assert res[0]["out"] == res[1]["out"] == [2.0, 2.0, 2.0]


def test_a_rank_whose_graph_differs_does_not_wait():
    lead = 2.0
    res = get_pool(2, timeout=300).run(_follow, lead, True)
    assert res[1]["alone"] == 1 and res[1]["shared"] == 0
    assert res[1]["start"] < lead / 2, res                     # it did not wait for rank 0's compile
    assert res[1]["out"] == [3.0, 3.0, 3.0]


def test_no_process_group_or_another_backend_is_not_wrapped():
    from autoshard.launch.compile_share import HostShared

    assert HostShared.for_compile({"backend": "inductor"}) is None        # no process group here
    assert HostShared.for_compile({"backend": "aot_eager"}) is None
