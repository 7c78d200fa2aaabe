"""``torch.compile`` of a sharded module (issue 20): the compiled graphs equal eager.

``ShardedModule.compile()`` compiles the rewritten graph modules (the input
checks and batch padding around them stay eager); ``torch.compile(sharded)`` of
the whole module works too, with graph breaks at those checks. Loss, logits and
every local gradient of the compiled run are compared with the eager run of the
same sharded module, and dynamo must find no graph break in the rewritten graph.
"""

from __future__ import annotations

import copy

import pytest
import torch

import models
from dist_pool import get_pool


def _compiled_vs_eager(rank, world, name, mode):
    depth = 2 if mode == "2.5d" else None
    import time

    import torch._dynamo

    import autoshard

    torch.set_num_threads(1)
    torch._dynamo.reset()
    dense = models.build(name)
    inputs = models.batch(name)
    eager = autoshard.shard(copy.deepcopy(dense), mode=mode, depth=depth, example_inputs=inputs)
    comp = autoshard.shard(copy.deepcopy(dense), mode=mode, depth=depth, example_inputs=inputs).compile()
    out_e = eager(**inputs)
    out_e.loss.backward()
    t0 = time.perf_counter()
    out_c = comp(**inputs)
    out_c.loss.backward()
    first = time.perf_counter() - t0
    fails = []
    for what, a, b in [("loss", out_c.loss, out_e.loss), ("logits", out_c.logits, out_e.logits)] + [
            (f"grad {n}", pc.grad, pe.grad) for (n, pc), (_, pe) in
            zip(comp.named_parameters(), eager.named_parameters())]:
        try:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        except AssertionError as e:
            fails.append(f"{what}: {str(e).splitlines()[0]}")
    # three more steps each: time compiled vs eager (a figure, not asserted); explain() last (it resets dynamo)
    times = {}
    for key, mod in (("eager", eager), ("compiled", comp)):
        t0 = time.perf_counter()
        for _ in range(3):
            mod(**inputs).loss.backward()
        times[key] = (time.perf_counter() - t0) / 3
    g = comp._graphs[0]
    full = g.accepts({k: v for k, v in inputs.items()})
    explained = torch._dynamo.explain(g.gm)(**full)
    reasons = [f"{r.reason[:200]} @ {r.user_stack[-1] if r.user_stack else ''}" for r in explained.break_reasons]
    return {"failures": fails, "graph_breaks": explained.graph_break_count, "reasons": reasons,
            "graphs": explained.graph_count, "first_call_s": first, "times": times}


@pytest.mark.parametrize("case", [("llama", "1d", 2), pytest.param(("llama", "2d", 4), marks=pytest.mark.slow),
                                  pytest.param(("gpt2", "3d", 8), marks=pytest.mark.slow),
                                  pytest.param(("bert", "2.5d", 8), marks=pytest.mark.slow)],
                         ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}")
def test_compiled_equals_eager(case):
    name, mode, world = case
    res = get_pool(world, timeout=900).run(_compiled_vs_eager, name, mode)
    for rank, r in enumerate(res):
        assert r["failures"] == [], f"rank {rank}: {r['failures']}"
        assert r["graph_breaks"] == 0 and r["graphs"] == 1, r
    print(f"\n{name} {mode}@{world}: compile (first call) {res[0]['first_call_s']:.1f} s; step "
          f"eager {res[0]['times']['eager'] * 1e3:.1f} ms, compiled {res[0]['times']['compiled'] * 1e3:.1f} ms")
