"""Models whose samples meet inside the graph (tests/test_batch_contract.py): tiny
configs of BatchNorm vision models (ResNet, SegFormer) and of losses that reduce over
the batch (label smoothing, class weights, ``reduction='none'``), and the
sharded-vs-dense check run on every rank of a pool: loss, logits, every local
gradient and the running statistics within 1e-5 of the dense model on the global
batch, then ``steps`` SGD steps on both."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

# name -> (model class, config class, config kwargs); tiny, BatchNorm in train mode
FAMILIES = {
    "resnet": ("ResNetForImageClassification", "ResNetConfig",
               dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)),
    "segformer": ("SegformerForSemanticSegmentation", "SegformerConfig",
                  dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                       num_attention_heads=[1, 2], decoder_hidden_size=64, num_labels=5, image_size=32,
                       patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2], hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, drop_path_rate=0.0)),
}


class LossProbe(torch.nn.Module):
    """Three Linears and a loss that reduces over the batch in a way the plain token
    cross-entropy does not: ``label_smoothing`` or class weights with ``reduction='none'``
    (then weighted by a per-sample factor and averaged)."""

    def __init__(self, kind: str, h: int = 32, classes: int = 16):
        import transformers

        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.kind = kind
        self.a, self.b, self.c = torch.nn.Linear(h, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, classes)
        self.register_buffer("w", torch.linspace(0.5, 2.0, classes))

    def forward(self, inputs_embeds, labels):
        x = inputs_embeds
        logits = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
        if self.kind == "smoothing":
            loss = F.cross_entropy(logits, labels, label_smoothing=0.1)
        else:
            per = F.cross_entropy(logits, labels, weight=self.w, reduction="none", ignore_index=3)
            loss = (per * (1 + x[:, 0].abs())).mean()      # a per-sample factor, then a batch mean
        return {"loss": loss, "logits": logits}


def build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    if name in ("smoothing", "weighted_none"):
        return LossProbe(name).train()
    import transformers

    cls, cfg_cls, kw = FAMILIES[name]
    return getattr(transformers, cls)(getattr(transformers, cfg_cls)(**kw)).train()


def inputs(name: str, b: int = 8, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    if name in ("smoothing", "weighted_none"):
        return {"inputs_embeds": torch.randn(b, 32, generator=g), "labels": torch.randint(0, 16, (b,), generator=g)}
    if name == "segformer":
        return {"pixel_values": torch.randn(b, 3, 32, 32, generator=g),
                "labels": torch.randint(0, 5, (b, 32, 32), generator=g)}
    return {"pixel_values": torch.randn(b, 3, 32, 32, generator=g), "labels": torch.randint(0, 10, (b,), generator=g)}


def _get(out, k):
    return out[k] if isinstance(out, dict) else getattr(out, k)


def check(rank: int, world: int, name: str, mode: str, depth=None, dp: int = 1, steps: int = 5) -> dict:
    """``shard(model)`` on the batch, then loss, logits, every local gradient and every
    buffer (the running statistics) against the dense model's (atol = rtol = 1e-5),
    then ``steps`` SGD steps on both, the losses and the buffers compared each step."""
    import autoshard
    import models
    from autoshard.runtime.collectives import CommLedger

    torch.set_num_threads(1)
    dense = build(name)
    model = copy.deepcopy(dense)
    whole = inputs(name)             # the global batch the dense model sees
    # each dp replica is handed its own rows (dp is the outermost mesh axis)
    per = whole[next(iter(whole))].shape[0] // dp
    rows = slice((rank // (world // dp)) * per, (rank // (world // dp) + 1) * per)
    batch = {k: v[rows] for k, v in whole.items()}
    sharded = autoshard.shard(model, mode=mode, depth=depth, dp=dp, example_inputs=batch)
    plan = sharded.plan
    failures: list = []
    worst = {"out": 0.0, "grad": 0.0, "buffers": 0.0, "steps": 0.0}
    strict = models.comparer(failures)

    def cmp(what, got, ref, key="out"):
        if got.shape == ref.shape and got.numel():
            worst[key] = max(worst[key], (got.double() - ref.double()).abs().max().item())
        strict(what, got, ref)

    def buffers(step):
        sb = dict(sharded.named_buffers())
        for k, ref in dense.named_buffers():
            if k in sb and ref.is_floating_point():
                cmp(f"step {step} buffer {k}", sb[k], ref, "buffers")

    opt_d = torch.optim.SGD(dense.parameters(), lr=0.1)
    opt_s = torch.optim.SGD(sharded.parameters(), lr=0.1)
    ledger = None
    for step in range(steps + 1):
        opt_d.zero_grad()
        opt_s.zero_grad()
        out_d = dense(**whole)
        _get(out_d, "loss").backward()
        with CommLedger() as led:
            out = sharded(**batch)
            _get(out, "loss").backward()
        if step == 0:
            ledger = (led.count(), led.bytes_per_rank())
            cmp("loss", _get(out, "loss"), _get(out_d, "loss"))
            cmp("logits", _get(out, "logits"), _get(out_d, "logits")[rows])
            dparams = dict(dense.named_parameters(remove_duplicate=False))
            sparams = dict(sharded.named_parameters(remove_duplicate=False))
            for pp in plan.params:
                got, ref = sparams[pp.name].grad, dparams[pp.name].grad
                if got is None or ref is None:
                    if (got is None) != (ref is None):
                        failures.append(f"grad {pp.name}: missing on one side")
                    continue
                cmp(f"grad {pp.name}", got, pp.spec.local(pp.pad(ref), plan.mesh, rank), "grad")
        else:
            cmp(f"step {step} loss", _get(out, "loss"), _get(out_d, "loss"), "steps")
        buffers(step)
        opt_d.step()
        opt_s.step()
    return {"failures": failures, "worst": worst, "fallbacks": [n.name for n in plan.fallbacks],
            "ledger": ledger, "plan": (len(plan.comms()), plan.comm_bytes_per_rank()),
            "synced": [n.name for n in plan.nodes if n.kernel is not None and n.kernel.name == "sync_batch_norm"]}
