"""Expert parallelism's dispatch and combine (``autoshard/runtime/experts.py``): a
token routed to an expert held on another rank reaches it, is computed there with
that expert's weight, and comes back; forward and backward equal the dense layer."""

from __future__ import annotations

import pytest
import torch

from dist_pool import get_pool

E, H, N = 4, 8, 4           # experts (2 per rank), features in, features out


ROUTINGS = {
    # each rank receives rows of one expert from two sources (arrival order != expert order)
    "crossed": [[3, 3, 1], [0, 0, 0, 2, 1]],
    # rank 0 receives nothing: its experts run on no rows, its weights' gradients are zero
    "one-sided": [[2, 3, 3], [3, 2]],
}


def _routing(world: int, kind: str = "crossed"):
    """Forced routing on 2 ranks (experts 0, 1 on rank 0; 2, 3 on rank 1): rank 0's rows
    go to expert 3 (twice, remote) and 1 (its own); rank 1's to expert 0 (three times,
    remote), 2 (its own) and 1 (remote). Each rank then receives rows of one expert
    from two sources, so the expert-major order differs from the arrival order. The
    weights and rows of every rank."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(E, H, N, generator=g)
    experts = [torch.tensor(e) for e in ROUTINGS[kind]]
    xs = [torch.randn(len(e), H, generator=g) for e in experts]
    return w, experts, xs


def _forced(rank, world, kind):
    from autoshard.ir.grouped import grouped_linear, grouped_ops
    from autoshard.ir.mesh import Mesh
    from autoshard.runtime import experts as X
    from autoshard.runtime.collectives import CommLedger
    from autoshard.runtime.groups import group_alias, mesh_group

    torch.set_num_threads(1)
    mesh = Mesh(axes=("ep",), sizes=(world,))
    mesh_group(mesh, ("ep",), rank)
    group = group_alias(mesh, ("ep",), False)
    w, experts, xs = _routing(world, kind)
    mine = experts[rank]
    x = xs[rank].clone().requires_grad_(True)
    order = torch.argsort(mine, stable=True)          # the model's sort by expert
    offs = torch.cumsum(torch.bincount(mine, minlength=E), 0).to(torch.int32)
    wl = w[rank * 2:(rank + 1) * 2].clone().requires_grad_(True)      # this rank's experts, whole
    impl = "aten" if "aten" in grouped_ops() else "transformers"
    with CommLedger() as led:
        route = X.ep_route(offs, group)
        y = grouped_linear(X.ep_dispatch(x[order], route), wl, X.ep_local_offs(route), False, impl)
        back = X.ep_combine(y, route)
        out = torch.empty_like(back).index_copy(0, order, back)        # un-sorted
        (out * torch.arange(out.numel()).view_as(out).float()).sum().backward()
    return {"out": out.detach(), "gx": x.grad, "gw": wl.grad, "send": route.send, "recv": route.recv,
            "calls": [(c.kind, c.buffer_bytes) for c in led.calls]}


@pytest.mark.parametrize("kind", list(ROUTINGS))
def test_forced_routing_reaches_the_remote_expert_and_comes_back(kind):
    """Tokens routed to experts on the other rank travel there (the receive counts say
    so), the product is that expert's, the result returns in the sender's row order, and the gradients of the rows and of every local expert
    equal the dense ones; the ledger holds the counts and rows exchanges with the bytes
    the routing implies (the rows a rank keeps do not travel)."""
    world = 2
    res = get_pool(world).run(_forced, kind)
    w, experts, xs = _routing(world, kind)
    gw = torch.zeros_like(w)
    for r, out in enumerate(res):
        ex = experts[r].tolist()
        cot = torch.arange(len(ex) * N).view(len(ex), N).float()      # the loss's weights
        torch.testing.assert_close(out["out"], torch.stack([xs[r][i] @ w[e] for i, e in enumerate(ex)]),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out["gx"], torch.stack([cot[i] @ w[e].t() for i, e in enumerate(ex)]),
                                   atol=1e-5, rtol=1e-5)
        for i, e in enumerate(ex):
            gw[e] += torch.outer(xs[r][i], cot[i])
    for r, out in enumerate(res):
        torch.testing.assert_close(out["gw"], gw[r * 2:(r + 1) * 2], atol=1e-5, rtol=1e-5)
    routes = (res[0]["send"], res[0]["recv"], res[1]["send"], res[1]["recv"])
    # crossed: rank 0 keeps 1 row and sends 2 to rank 1; rank 1 sends 4 to rank 0 and keeps 1
    assert routes == {"crossed": ((1, 2), (1, 4), (4, 1), (2, 1)), "one-sided": ((0, 3), (0, 0), (0, 2), (3, 2))}[kind]
    for r, out in enumerate(res):
        off = sum(out["send"]) - out["send"][r]
        back = sum(out["recv"]) - out["recv"][r]
        # counts (2 experts' int64 to the other rank), rows out, results back, then their gradients
        assert out["calls"] == [("all_to_all", 16), ("all_to_all", off * H * 4), ("all_to_all", back * N * 4),
                                ("all_to_all", off * N * 4), ("all_to_all", back * H * 4)], out["calls"]
