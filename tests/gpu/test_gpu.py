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

if os.environ.get("AUTOSHARD_GPU_TESTS") != "1":
    pytest.skip("GPU tests: run `make test-gpu` on a machine with CUDA GPUs", allow_module_level=True)
if not torch.cuda.is_available():           # make test-gpu where there is no GPU: an error, never a pass
    from preflight import why_not

    raise RuntimeError(f"make test-gpu: {why_not()}")

NGPU = torch.cuda.device_count()


def _cases(n: int) -> list[tuple]:
    """``(mode, dp, cp, depth)`` for every mode on ``n`` ranks, with dp and cp where they
    divide (the policies refuse the rest): 1 GPU runs 1d alone; 2 add dp, cp and 1d-sp;
    4 add 2d; 8 add 2.5d and 3d, and 2d with dp or cp."""
    from autoshard.policies import make_policy

    out = []
    for mode, depth in (("1d", None), ("1d-sp", None), ("2d", None), ("2.5d", 2), ("3d", None)):
        for dp, cp in ((1, 1), (2, 1), (1, 2), (2, 2)):
            if n % (dp * cp) or (mode != "1d" and n // (dp * cp) == 1):
                continue
            try:
                make_policy(mode, n, depth, dp, cp)
            except Exception:       # noqa: BLE001 - this mesh does not fit n ranks (or cp with this mode)
                continue
            out.append((mode, dp, cp, depth))
    return out


CASES = _cases(NGPU)
# the models: 8 heads (8 kv heads), hidden 64, vocabulary 128: every split of 2, 4 and 8 divides
W = {"llama": "llama-h8", "gpt2": "gpt2-h8", "bert": "bert-h8"}
MODES = [("1d", None)] + [(m, d) for m, dp, cp, d in CASES if m != "1d" and dp == cp == 1]


def _case_id(c) -> str:
    mode, dp, cp, depth = c
    return f"{mode}-dp{dp}-cp{cp}" + (f"-d{depth}" if depth else "")


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


def _equivalence(rank, world, name, mode, dp=1, cp=1, depth=None):
    """The sharded step against the dense model on this GPU: each dp replica its own 4 rows
    of the global batch (16 tokens: cp and 1d-sp divide it), the loss the global mean."""
    import autoshard

    torch.manual_seed(0)
    dense = models.build(name).cuda()
    full = {k: v.cuda() for k, v in models.batch(name, b=4 * dp, s=16).items()}
    rows = slice((rank // (world // dp)) * 4, (rank // (world // dp) + 1) * 4)
    inputs = {k: v[rows] for k, v in full.items()}
    sharded = autoshard.shard(copy.deepcopy(dense).cpu(), mode=mode, dp=dp, cp=cp, depth=depth,
                              example_inputs={k: v.cpu() for k, v in inputs.items()})
    out_d, out_s = dense(**full), sharded(**inputs)
    out_d.loss.backward()
    out_s.loss.backward()
    return {"device": str(sharded.device), "off_device": _local_device_only(sharded),
            "logits": (out_s.logits - out_d.logits[rows]).abs().max().item(),
            "loss": abs(out_s.loss.item() - out_d.loss.item()),
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
    for rank, r in enumerate(run_on_gpus(_equivalence, W[name], mode, 1, 1, depth)):
        assert r["backend"] == "nccl" and r["device"] == f"cuda:{rank}", r
        assert r["off_device"] == [], r
        assert r["logits"] <= 1e-5 and r["loss"] <= 1e-5 and r["grad"] <= 1e-5, r


@pytest.mark.parametrize("case", [c for c in CASES if c[1] * c[2] > 1], ids=_case_id)
def test_dp_and_cp_equal_to_dense_on_nccl(case):
    """Every mode with data and context parallelism at this GPU count (Llama: causal, ring attention)."""
    mode, dp, cp, depth = case
    for rank, r in enumerate(run_on_gpus(_equivalence, W["llama"], mode, dp, cp, depth)):
        assert r["device"] == f"cuda:{rank}" and r["off_device"] == [], r
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
    # their heads (4) divide up to 4 ranks
    for rank, r in enumerate(run_on_gpus(_family, name, world=min(NGPU, 4))):
        assert r["device"] == f"cuda:{rank}" and r["off_device"] == [], r
        assert r["out"] <= 1e-5 and r["loss"] <= 1e-5 and r["grad"] <= 1e-5, r


def _generate(rank, world):
    import autoshard

    torch.manual_seed(0)
    dense = models.build("gpt2-h8").cuda().eval()
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
    dense = models.build("gpt2-h8").cuda()
    sharded = autoshard.shard(copy.deepcopy(dense).cpu(), mode="1d")
    batch = [{k: v.cuda() for k, v in models.batch("gpt2-h8").items()}]
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
    dense = models.build("gpt2-h8")
    inputs = models.batch("gpt2-h8")
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
    inputs = models.batch("gpt2-h8")
    sharded = autoshard.shard(models.build("gpt2-h8"), mode="1d", example_inputs=inputs)
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


# ------------------------------------------------------------------ training paths
def _train_paths(rank, world, how, mode, dp, cp, depth):
    """Three steps of ``how`` against the dense model's (AdamW, global-norm clip):
    ``"zero2"`` (ZeroAdamW stage 2 over dp), ``"fsdp"`` (shard(fsdp=True): FSDP2 over dp),
    ``"compile"`` (sharded.compile()), ``"autocast"`` (bf16 autocast, the dense run alike)."""
    import autoshard
    from autoshard.training import train as T
    from autoshard.training.zero import ZeroAdamW

    torch.manual_seed(0)
    dense = models.build("llama-h8").cuda()
    full = {k: v.cuda() for k, v in models.batch("llama-h8", b=4 * dp, s=16).items()}
    rows = slice((rank // (world // dp)) * 4, (rank // (world // dp) + 1) * 4)
    mine = {k: v[rows] for k, v in full.items()}
    sharded = autoshard.shard(copy.deepcopy(dense).cpu(), mode=mode, dp=dp, cp=cp, depth=depth, fsdp=how == "fsdp",
                              example_inputs={k: v.cpu() for k, v in mine.items()})
    if how == "compile":
        sharded.compile()
    opt = ZeroAdamW(sharded, lr=1e-3, stage=2) if how == "zero2" else torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    dtype = torch.bfloat16 if how == "autocast" else None
    got = [T.train_step(sharded, [mine], opt, clip=0.5, dtype=dtype) for _ in range(3)]
    dopt = torch.optim.AdamW(dense.parameters(), lr=1e-3)
    want = [T.train_step(dense, [full], dopt, clip=0.5, dtype=dtype) for _ in range(3)]
    return got, want


TRAIN = ([("zero2", c) for c in CASES if c[1] == 2][:1] + [("fsdp", c) for c in CASES if c[1] == 2][:1]
         + [("compile", c) for c in CASES if c[1] * c[2] == 1] + [("autocast", c) for c in CASES if c[1] * c[2] == 1])


@pytest.mark.parametrize("how,case", TRAIN, ids=[f"{h}-{_case_id(c)}" for h, c in TRAIN])
def test_training_paths_follow_dense(how, case):
    """ZeRO-2 and FSDP2 (where dp = 2 fits), compile and bf16 autocast in every mode: the
    loss and the clipped norm of three steps follow the dense run (fp32: 1e-4; bf16: 2e-2)."""
    tol = 2e-2 if how == "autocast" else 1e-4
    for rank, (got, want) in enumerate(run_on_gpus(_train_paths, how, *case)):
        for (ls, ns), (ld, nd) in zip(got, want):
            assert math.isfinite(ls) and abs(ls - ld) <= tol * abs(ld) and abs(ns - nd) <= tol * abs(nd), \
                (rank, got, want)


def _no_sync(rank, world, mode, dp, cp, depth):
    """A warm step, then one under ``torch.cuda.set_sync_debug_mode("error")``: any host
    sync in forward, backward, the gradient sync or the optimizer step raises."""
    import autoshard

    torch.manual_seed(0)
    dense = models.build("llama-h8")
    inputs = {k: v.cuda() for k, v in models.batch("llama-h8", b=4, s=16).items()}
    sharded = autoshard.shard(dense, mode=mode, dp=dp, cp=cp, depth=depth,
                              example_inputs={k: v.cpu() for k, v in inputs.items()})
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3, capturable=True)
    for debug in ("default", "error"):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(debug)
        try:
            with torch.autocast("cuda", torch.bfloat16):
                loss = sharded(**inputs).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return True


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_a_step_makes_no_host_sync(case):
    """No kernel reads a device value on the host: a bf16 step in every mode and layout runs
    under ``set_sync_debug_mode("error")`` (tests/runtime/test_host_syncs.py scans the source)."""
    assert all(run_on_gpus(_no_sync, *case))
