"""The CUDA + NCCL path, one rank per GPU (``make test-gpu``; skipped without GPUs).

Each test starts its ranks as torchrun would (tests/gpu/gpu_ranks.py) and lets
``autoshard.shard`` join the job by the device rule. Checked against the dense
model on the same GPU (fp32, TF32 off): logits, loss and every local gradient;
every tensor and graph literal on the rank's own GPU; ``generate``; a bf16
training step with gradient clipping; a checkpoint round trip. With one GPU the
mesh has one rank (the collectives still run through NCCL); 2d runs where the
GPU count is a square of at least 4.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

import models
from gpu_ranks import run_on_gpus

pytestmark = pytest.mark.skipif(
    os.environ.get("AUTOSHARD_GPU_TESTS") != "1" or not torch.cuda.is_available(),
    reason="GPU tests: run `make test-gpu` on a machine with CUDA GPUs")

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
MODES = [("1d", None)] + ([("2d", None)] if NGPU >= 4 and math.isqrt(NGPU) ** 2 == NGPU else [])


def _local_device_only(sharded) -> list[str]:
    from autoshard.runtime.device import lifted_constants

    dev = torch.device("cuda", torch.cuda.current_device())
    bad = [n for n, t in list(sharded.named_parameters()) + list(sharded.named_buffers()) if t.device != dev]
    bad += [n for _, n, t in lifted_constants(sharded.graph_module()) if t.device != dev]
    gm = sharded.graph_module()
    for node in gm.graph.nodes:
        for v in list(node.args) + list(node.kwargs.values()):
            if isinstance(v, torch.device) and v != dev:
                bad.append(f"{node.name}: device={v}")
    return bad


def _equivalence(rank, world, name, mode):
    import autoshard

    torch.manual_seed(0)
    dense = models.build(name).cuda()
    inputs = {k: v.cuda() for k, v in models.batch(name).items()}
    sharded = autoshard.shard(copy.deepcopy(dense).cpu(), mode=mode, example_inputs={k: v.cpu() for k, v in inputs.items()})
    out_d, out_s = dense(**inputs), sharded(**inputs)
    out_d.loss.backward()
    out_s.loss.backward()
    return {"device": str(sharded.device), "off_device": _local_device_only(sharded),
            "logits": (out_s.logits - out_d.logits).abs().max().item(), "loss": abs(out_s.loss.item() - out_d.loss.item()),
            "grad": _worst_grad(sharded, dense, rank), "backend": torch.distributed.get_backend()}


def _worst_grad(sharded, dense, rank) -> float:
    """The largest difference between a local gradient and the dense gradient's block."""
    grads = {n: p.grad for n, p in dense.named_parameters()}
    worst = 0.0
    for pp in sharded.plan.params:
        p = dict(sharded.named_parameters()).get(pp.name)
        if p is None or p.grad is None or grads.get(pp.name) is None:
            continue
        worst = max(worst, (p.grad - pp.spec.local(pp.pad(grads[pp.name]), sharded.mesh, rank)).abs().max().item())
    return worst


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("mode,depth", MODES)
def test_equal_to_dense_on_nccl(name, mode, depth):
    for rank, r in enumerate(run_on_gpus(_equivalence, name, mode)):
        assert r["backend"] == "nccl" and r["device"] == f"cuda:{rank}", r
        assert r["off_device"] == [], r
        assert r["logits"] <= 1e-5 and r["loss"] <= 1e-5 and r["grad"] <= 1e-5, r


def _family(rank, world, name):
    """A model of another modality (tests/modality.py) or gpt-oss (its experts run
    ``torch._grouped_mm`` on CUDA, transformers' CPU fallback here): ``shard(model)``
    with no example inputs, then its own batch on the GPU."""
    import autoshard
    import modality

    torch.manual_seed(0)
    dense = modality.build(name) if name in modality.FAMILIES else models.build(name)
    batch = modality.inputs(name, dense, b=2) if name in modality.FAMILIES else models.batch(name)
    dense.cuda()
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    sharded = autoshard.shard(copy.deepcopy(dense).cpu(), mode="1d")
    out_d, out_s = dense(**inputs), sharded(**inputs)
    out_d.loss.backward()
    out_s.loss.backward()
    return {"device": str(sharded.device), "off_device": _local_device_only(sharded),
            "out": (out_s.logits - out_d.logits).abs().max().item(),
            "loss": abs(out_s.loss.item() - out_d.loss.item()), "grad": _worst_grad(sharded, dense, rank)}


@pytest.mark.parametrize("name", ["vit", "whisper", "llava", "gptoss"])
def test_other_modalities_and_experts_on_nccl(name):
    for rank, r in enumerate(run_on_gpus(_family, name)):
        assert r["device"] == f"cuda:{rank}" and r["off_device"] == [], r
        assert r["out"] <= 1e-5 and r["loss"] <= 1e-5 and r["grad"] <= 1e-5, r


def _generate(rank, world):
    import autoshard

    torch.manual_seed(0)
    dense = models.build("gpt2").cuda().eval()
    sharded = autoshard.shard(copy.deepcopy(dense).cpu(), mode="1d")
    ids = torch.randint(3, 100, (2, 5))
    want = dense.generate(input_ids=ids.cuda(), attention_mask=torch.ones_like(ids).cuda(), max_new_tokens=6,
                          do_sample=False)
    got = sharded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    return want.cpu().tolist(), got.cpu().tolist(), str(got.device)


def test_generate_on_nccl():
    for want, got, dev in run_on_gpus(_generate):
        assert got == want and dev.startswith("cuda"), (want, got, dev)


def _bf16_steps(rank, world):
    import autoshard
    from autoshard.training import train as T

    torch.manual_seed(0)
    dense = models.build("gpt2").cuda()
    sharded = autoshard.shard(copy.deepcopy(dense).cpu(), mode="1d")
    batch = [{k: v.cuda() for k, v in models.batch("gpt2").items()}]
    out = []
    for m in (sharded, dense):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        out.append([T.train_step(m, batch, opt, clip=0.5, dtype=torch.bfloat16) for _ in range(3)])
    return out


def test_bf16_steps_with_clipping_follow_dense():
    for sharded, dense in run_on_gpus(_bf16_steps):
        for (ls, ns), (ld, nd) in zip(sharded, dense):
            assert math.isfinite(ls) and math.isfinite(ns)
            assert abs(ls - ld) <= 2e-2 * abs(ld) and abs(ns - nd) <= 2e-2 * abs(nd), (sharded, dense)


def _checkpoint(rank, world, path):
    import transformers

    import autoshard

    torch.manual_seed(0)
    dense = models.build("gpt2")
    inputs = models.batch("gpt2")
    sharded = autoshard.shard(copy.deepcopy(dense), mode="1d", example_inputs=inputs)
    ref = sharded(**inputs).logits
    sharded.save_checkpoint(os.path.join(path, "ckpt"))
    sharded.save_pretrained(os.path.join(path, "hf"))
    again = autoshard.load_checkpoint(os.path.join(path, "ckpt"), copy.deepcopy(dense), mode="1d",
                                      example_inputs=inputs)
    back = again(**inputs).logits
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(path, "hf")).cuda()
    return ((back - ref).abs().max().item(), (hf(**{k: v.cuda() for k, v in inputs.items()}).logits - ref)
            .abs().max().item(), str(again.device))


def test_checkpoint_round_trip_on_nccl(tmp_path):
    for again, hf, dev in run_on_gpus(_checkpoint, str(tmp_path)):
        assert again == 0.0 and hf <= 1e-5 and dev.startswith("cuda"), (again, hf, dev)


def _dcp(rank, world, path):
    from torch.distributed.tensor import DTensor

    import autoshard
    from autoshard.io import dcp as adcp

    torch.manual_seed(0)
    inputs = models.batch("gpt2")
    sharded = autoshard.shard(models.build("gpt2"), mode="1d", example_inputs=inputs)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2, eps=1e-3)
    sharded(**inputs).loss.backward()
    opt.step()
    sd = sharded.state_dict()
    kinds = {(type(v).__name__, str(v.device_mesh.device_type)) for v in sd.values() if isinstance(v, DTensor)}
    adcp.save(sharded, path, optimizer=opt)
    ref = sharded(**inputs).logits.detach()
    opt.zero_grad()
    sharded(**inputs).loss.backward()
    opt.step()
    next_ref = sharded(**inputs).loss.item()
    other = autoshard.shard(models.build("gpt2", seed=1), mode="1d", example_inputs=inputs)
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-2, eps=1e-3)
    adcp.load(other, path, optimizer=opt2)
    got = other(**inputs).logits.detach()
    other(**inputs).loss.backward()
    opt2.step()
    return {"kinds": sorted(kinds), "logits": (got - ref).abs().max().item(),
            "next": abs(other(**inputs).loss.item() - next_ref), "device": str(other.device)}


def test_dtensor_state_dict_and_dcp_on_nccl(tmp_path):
    """state_dict() gives CUDA DTensors; a DCP save (model + AdamW state) loads into a module with
    other weights and gives the same logits and the same next step."""
    for r in run_on_gpus(_dcp, str(tmp_path / "dcp")):
        assert r["kinds"] == [("DTensor", "cuda")] and r["device"].startswith("cuda"), r
        assert r["logits"] <= 1e-6 and r["next"] <= 1e-5, r
