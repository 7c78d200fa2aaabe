"""Under ``torch.compile`` the kernels read their rank from a graph op
(``autoshard::group_rank``), so the traced graph is one program on every rank; the
results and gradients equal the eager kernels', the padding row of the vocab-parallel
embedding included (its rank is unknown while tracing; its gradient is stopped by a
``where`` instead of ``F.embedding``'s ``padding_idx``)."""

from __future__ import annotations

import models
from dist_pool import get_pool


def _compiled_kernels(rank, world):
    import torch
    import torch._dynamo
    import torch.distributed as dist

    from autoshard.runtime import collectives as C
    from autoshard.runtime import parallel_ops

    torch.set_num_threads(1)
    torch._dynamo.reset()
    group = dist.new_group(list(range(world))).group_name
    torch.manual_seed(0)
    v, h = 8 * world, 4
    w_full = torch.randn(v, h)
    ids = torch.tensor([[0, 3, 2, v - 1, 3, 9], [3, 3, 1, 0, v - 2, 5]])
    target = torch.tensor([1, v - 1, 3, 0, 2, v // 2])
    logits_full = torch.randn(6, v)
    x_full = torch.randn(world * 3, 5)
    scale = torch.arange(world * 3 * 5, dtype=torch.float32).view(world * 3, 5)

    def run(fn):
        w = w_full.chunk(world)[rank].clone().requires_grad_(True)
        logits = logits_full.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
        x = x_full.chunk(world)[rank].clone().requires_grad_(True)
        emb, loss, whole = fn(w, logits, x)
        (emb.square().sum() + loss + (whole * scale).sum()).backward()
        return emb.detach(), loss.detach(), whole.detach(), w.grad, logits.grad, x.grad

    def kernels(w, logits, x):
        emb = parallel_ops.vocab_embedding(w, ids, group=group, padding_idx=3)
        loss = parallel_ops.cross_entropy(logits, target, vocab_group=group, batch_group=None)
        return emb, loss, C.gather_from(x, 0, group)       # its backward keeps this rank's block: local_block

    eager = run(kernels)
    graphs = {}
    backend = models.aot_recorder(graphs)
    compiled = run(torch.compile(kernels, backend=backend, fullgraph=True))
    diffs = [float((a - b).abs().max()) for a, b in zip(eager, compiled)]
    pad_grad = float(compiled[3].abs().sum(-1)[3]) if rank == 0 else None
    return {"diffs": diffs, "graphs": graphs, "pad_grad": pad_grad}


def test_kernels_read_their_rank_from_the_graph():
    res = get_pool(2, timeout=300).run(_compiled_kernels)
    for rank, r in enumerate(res):
        assert max(r["diffs"]) < 1e-6, f"rank {rank}: {r['diffs']}"
        assert "autoshard.group_rank" in r["graphs"]["forward"] and "autoshard.group_rank" in r["graphs"]["backward"]
    assert res[0]["graphs"] == res[1]["graphs"], "the traced graphs differ between ranks"
    assert res[0]["pad_grad"] == 0.0           # the padding row (id 3, rank 0's) has no gradient
