"""Models that are not Hugging Face models: a plain ``nn.Module`` with no ``.config``
(tests/test_plain_modules.py).

:class:`Transformer` is PyTorch's own tensor-parallel test model
(``torch.testing._internal.distributed._tensor.common_dtensor.Transformer``, nanoGPT-like:
token and position embeddings, pre-norm blocks of ``wq/wk/wv/wo`` attention and a GELU
MLP, an output head tied to the token embedding, ``forward(tokens)`` returning the
logits), copied here without its DTensor helpers (importing that module needs torch's
test dependencies)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutput     # imported here: a ModelOutput class made during
                                                              # export is not registered with pytree


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 64
    max_seq_len: int = 16
    dim: int = 32
    n_heads: int = 4
    dropout_p: float = 0.0
    use_attn_mask: bool = True
    weight_tying: bool = True


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.n_heads = args.n_heads
        self.dropout_p = args.dropout_p
        self.resid_dropout = nn.Dropout(args.dropout_p)
        self.use_attn_mask = args.use_attn_mask
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x):
        bsz, seq_len, _ = x.size()
        q = self.wq(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, None, self.dropout_p if self.training else 0,
                                             self.use_attn_mask)
        return self.resid_dropout(self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1)))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, dropout_p):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x):
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.dropout_p)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.model_args = args
        self.max_seq_len = args.max_seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.n_layers)])
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        _bsz, seq_len = tokens.size()
        if seq_len > self.max_seq_len:
            raise AssertionError(f"Expected seq_len <= max_seq_len, got {seq_len} > {self.max_seq_len}")
        h = self.tok_embeddings(tokens)
        pos = torch.arange(0, seq_len, device=tokens.device)
        h = self.dropout(h + self.pos_embeddings(pos))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


def transformer(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelArgs())


class ViTAttention(nn.Module):
    """timm's ``vision_transformer.Attention``: one fused ``qkv`` Linear whose output is
    reshaped to ``(batch, tokens, 3, heads, head_dim)`` and unbound into q, k, v."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class ViTBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ViTAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential()
        self.mlp.fc1, self.mlp.act, self.mlp.fc2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """timm's ``VisionTransformer`` as ``timm.create_model("vit_tiny_patch16_224", ...)``
    builds it (conv patch embedding, class token, learned positions, pre-norm blocks,
    class-token pooling, ``head``), small; ``forward(x)`` takes images ``[B, 3, H, W]``.
    timm itself needs torchvision, whose PyPI wheel does not load on the CPU torch this
    project pins, so the tests use this copy and run timm only where it imports."""

    def __init__(self, img_size: int = 16, patch_size: int = 4, dim: int = 32, depth: int = 2, num_heads: int = 4,
                 num_classes: int = 10):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, dim, patch_size, patch_size)
        n = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[ViTBlock(dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def vit(seed: int = 0) -> ViT:
    torch.manual_seed(seed)
    return ViT()


class Outputs(nn.Module):
    """``inner``'s logits returned as ``kind``: a tensor, a tuple, a dict or a ``ModelOutput``,
    with a second, per-sample value (the logits' mean over classes) beside them."""

    def __init__(self, inner: nn.Module, kind: str):
        super().__init__()
        self.inner, self.kind = inner, kind

    def forward(self, tokens, scale: float = 1.0):
        logits = self.inner(tokens) * scale
        extra = logits.mean(-1)
        if self.kind == "tensor":
            return logits
        if self.kind == "tuple":
            return logits, extra
        if self.kind == "dict":
            return {"logits": logits, "extra": extra}
        return CausalLMOutput(logits=logits, hidden_states=(extra,))


BUILD = {"transformer": transformer, "vit": vit}


def inputs_of(name: str, b: int = 4, s: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input, target)``: token ids and next tokens for the transformer, images and class
    labels for the ViT."""
    g = torch.Generator().manual_seed(seed)
    if name == "vit":
        return torch.randn(b, 3, 16, 16, generator=g), torch.randint(0, 10, (b,), generator=g)
    tokens = torch.randint(0, 64, (b, s), generator=g)
    return tokens, tokens.roll(-1, 1)


def _logits(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[0]
    return out["logits"]


def user_loss(out, target):
    """The loss a user computes outside the module, from its (gathered) logits."""
    logits = _logits(out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def check(rank: int, world: int, name: str, mode: str, depth=None, *, kind: str = "tensor", call: str = "positional",
          steps: int = 3, batch: int = 4, seq: int = 8) -> dict:
    """Shard a plain module (no ``.config``), call it as its users do (``call``: tokens
    positionally, by keyword, or ``"first-call"``: no example inputs at all), compute the
    loss outside it, and compare outputs, loss, every local gradient and ``steps`` AdamW
    steps with the dense module's. Returns ``{"failures": [...], ...}`` (empty = exact)."""
    import copy

    import autoshard

    torch.set_num_threads(1)
    base = BUILD[name]()
    dense = base if kind == "tensor" else Outputs(base, kind)
    model = copy.deepcopy(dense)
    x, target = inputs_of(name, b=batch, s=seq)
    extra = {} if kind == "tensor" else {"scale": 0.5}
    key = "x" if name == "vit" else "tokens"
    example = (x,) if call == "positional" else {key: x, **extra} if call == "keyword" else None
    sharded = autoshard.shard(model, mode=mode, depth=depth, example_inputs=example)
    failures: list = []
    # what a client library calls on a PreTrainedModel (autoshard/hf_face.py)
    sharded.gradient_checkpointing_enable()         # the blocks recompute in backward: still exact
    sharded.add_model_tags(["client"])
    try:
        emb = sharded.get_input_embeddings()
        embedding = any(emb.weight is p for p in sharded.parameters())
    except autoshard.ConfigError as e:      # an image model has none: refused by name
        embedding = str(e)
    face = {"checkpointing": sharded.is_gradient_checkpointing, "tags": sharded.model_tags,
            "base": sharded.base_model is sharded, "embedding": embedding,
            "remat_blocks": sum(1 for n, _ in sharded.graph_module().named_children() if n.startswith("_remat"))}

    def cmp(what, got, ref):
        try:
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        except AssertionError as e:
            failures.append(f"{what}: {str(e).splitlines()[-1]}")

    out_d = dense(x, **extra)
    out = sharded(x, **extra) if call != "keyword" else sharded(**{key: x}, **extra)
    if type(out) is not type(out_d):
        failures.append(f"output type {type(out).__name__}, dense {type(out_d).__name__}")
    if kind in ("tuple", "dict", "model_output"):
        cmp("second output", out[1] if kind == "tuple" else out["extra"] if kind == "dict" else out.hidden_states[0],
            out_d[1] if kind == "tuple" else out_d["extra"] if kind == "dict" else out_d.hidden_states[0])
    cmp("logits", _logits(out), _logits(out_d))
    loss, loss_d = user_loss(out, target), user_loss(out_d, target)
    cmp("loss", loss, loss_d)
    loss.backward()
    loss_d.backward()
    plan = sharded.plan
    import models       # tests/models.py (on the ranks' path, as this module is)

    models.compare_local_grads(cmp, failures, plan, sharded, dense, rank)
    dparams = dict(dense.named_parameters(remove_duplicate=False))
    sparams = dict(sharded.named_parameters(remove_duplicate=False))
    losses = {}
    for tag, m in (("sharded", sharded), ("dense", dense)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)      # AdamW would blow up the
        # noise of a gradient that is zero in exact arithmetic (a key bias) into whole steps
        losses[tag] = []
        for _ in range(steps):
            opt.zero_grad()
            step_loss = user_loss(m(x, **extra), target)
            step_loss.backward()
            opt.step()
            losses[tag].append(step_loss.detach())
    for i, (a, b) in enumerate(zip(losses["sharded"], losses["dense"])):
        cmp(f"step {i} loss", a, b)
    if extra:       # another value of a non-tensor argument: another graph, captured from the module's skeleton
        with torch.no_grad():
            cmp("logits at scale=2", _logits(sharded(x, scale=2.0)), _logits(dense(x, scale=2.0)))
    for pp in plan.params:      # the weights after the steps, this rank's block of the dense ones
        cmp(f"stepped {pp.name}", sparams[pp.name].detach(),
            pp.spec.local(pp.pad(dparams[pp.name].detach()), plan.mesh, rank))
    return {"failures": failures, "whole": plan.whole_report(), "fallbacks": [n.name for n in plan.fallbacks],
            "split": sorted(pp.name for pp in plan.params if pp.spec.axes),
            "signatures": sharded.signatures, "face": face}
