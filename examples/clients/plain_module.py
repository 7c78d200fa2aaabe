"""Shard a module that is not a transformers model: no config, its own input names,
called positionally, its logits returned as a tensor, the loss computed outside it.

The model is a timm-style ViT (``forward(x)``: images in, class logits out); a timm
model itself goes through the same call (``timm.create_model(...)`` in place of
``TinyViT()``). Checks the logits, the loss, every local gradient and three SGD steps
against the dense model; exit code 1 if any differs by more than 1e-5.

    torchrun --nproc-per-node 2 examples/clients/plain_module.py
    torchrun --nproc-per-node 4 examples/clients/plain_module.py --mode 2d
"""

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autoshard


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyViT(nn.Module):
    def __init__(self, img=16, patch=4, dim=32, depth=2, heads=4, classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="1d")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dense = TinyViT()
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    # example_inputs as the module is called: a tuple binds to forward's parameters (here x)
    sharded = autoshard.shard(copy.deepcopy(dense), mode=args.mode, example_inputs=(images,))
    worst = 0.0
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (sharded, dense)]
    for step in range(3):
        logits, ref = sharded(images), dense(images)
        loss, ref_loss = F.cross_entropy(logits, labels), F.cross_entropy(ref, labels)     # the user's loss
        loss.backward()
        ref_loss.backward()
        worst = max(worst, (logits - ref).abs().max().item(), (loss - ref_loss).abs().item())
        params = dict(dense.named_parameters())
        for pp in sharded.plan.params:          # this rank's block of every dense gradient
            want = pp.spec.local(params[pp.name].grad, sharded.mesh, dist.get_rank())
            worst = max(worst, (sharded.get_parameter(pp.name).grad - want).abs().max().item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    if dist.get_rank() == 0:
        print(sharded)
        print(f"3 steps, worst difference to dense {worst:.2e}")
    dist.destroy_process_group()
    raise SystemExit(0 if worst <= 1e-5 else 1)


if __name__ == "__main__":
    main()
