"""Per-rank worker functions of the multi-rank benchmarks (run by tests/dist_pool's
RankPool: ``fn(rank, world_size, *args)``; module-level so they pickle)."""

from __future__ import annotations

import math
import time


def _tiny_llama(cfg_kw: dict, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg_kw))
    model.train()
    return model


def _batch(vocab: int, b: int, s: int, seed: int = 1) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(b, s, dtype=torch.long), "labels": ids.clone()}


def _replica_batch(cfg_kw: dict, rank: int, world: int, dp: int, b: int, s: int) -> dict:
    """This rank's dp replica's rows of the benchmarks' global batch (``b`` rows × ``s``)."""
    full = _batch(cfg_kw["vocab_size"], b, s)
    tp, rows = world // dp, b // dp
    return {k: v[(rank // tp) * rows:(rank // tp + 1) * rows] for k, v in full.items()}


def formula_bytes(plan) -> dict:
    """The per-rank bytes of the formulas in docs/design.md, "Communication and memory",
    for the nodes they cover, and the plan's bytes for the same nodes (fp32 elements;
    ring model)."""
    mesh, mode = plan.mesh, plan.mode
    params = {}
    for p in plan.params:
        for n in (p.name, *p.aliases):
            params[n] = p
    sync = {}
    for c, p in zip([c for c in plan.grad_sync_comms()], [p for p in plan.params if p.grad_sync and not p.is_buffer]):
        sync[p.name] = c.bytes_per_rank
    formula = planned = 0.0
    if mode == "1d":
        p = mesh.size("tp")
        layers = sorted({n.module.split(".layers.")[1].split(".")[0] for n in plan.nodes if ".layers." in n.module})
        hid = next(n.global_shape[-1] for n in plan.nodes if n.kind == "embedding")
        tokens = plan.batch_size * plan.seq_len
        formula = len(layers) * 8 * (p - 1) / p * tokens * hid * 4
        planned = sum(n.comm_bytes for n in plan.nodes if ".layers." in n.module)
        return {"formula": formula, "plan_same_nodes": planned, "covers": f"{len(layers)} transformer layers"}
    kern = {"2d": "summa", "2.5d": "summa", "3d": "three_d"}[mode]
    nodes = [n for n in plan.nodes if n.kernel is not None and n.kernel.name == kern]
    for n in nodes:
        N, nf = math.prod(n.global_shape[:-1]), n.global_shape[-1]
        w = params.get(f"{n.module}.weight")
        nd = getattr(n.kernel, "n_dim", 0)
        k = w.global_shape[1 - nd]
        if mode == "3d":
            q = mesh.size("x")
            formula += 2 * (q - 1) / q ** 3 * (N * k + k * nf + N * nf) * 4
        else:
            q = mesh.size("row")
            d = mesh.size("dep") if "dep" in mesh.axes else 1
            formula += (3 * (q - 1) / q ** 2 * (N * k / d + k * nf) + 2 * (d - 1) / d * k * nf / q ** 2) * 4
        planned += n.comm_bytes + sync.get(w.name, 0.0)
    return {"formula": formula, "plan_same_nodes": planned, "covers": f"{len(nodes)} {kern} Linears"}


def comm_and_memory(rank: int, world: int, mode: str, depth, cfg_kw: dict, b: int, s: int) -> dict:
    """One forward + backward of a tiny Llama sharded by ``mode``: the ledger, the plan,
    parameter / gradient bytes, and the bytes saved for backward (peak activations)."""
    import warnings

    import torch

    import autoshard
    from autoshard.planning.activations import SavedBytes
    from autoshard.runtime.collectives import CommLedger

    warnings.filterwarnings("ignore", category=FutureWarning)    # gloo's *_tensor deprecations
    torch.set_num_threads(1)
    model = _tiny_llama(cfg_kw)
    inputs = _batch(cfg_kw["vocab_size"], b, s)
    sharded = autoshard.shard(model, mode=mode, depth=depth, example_inputs=inputs)
    plan = sharded.plan
    with CommLedger() as led:
        with SavedBytes(sharded.parameters()) as saved:
            out = sharded(**inputs)
        out.loss.backward()
    est = autoshard.estimate(plan, "cpu-gloo")
    return {
        "ledger_bytes": led.bytes_per_rank(), "ledger_calls": led.count(),
        "ledger_by_kind": {f"{k}({g})": v for (k, g), v in led.by_kind().items()},
        "plan_bytes": plan.comm_bytes_per_rank(), "plan_calls": len(plan.comms()),
        "param_bytes": sum(p.numel() * p.element_size() for p in sharded.parameters()),
        "plan_param_bytes": plan.param_bytes_per_rank,
        "grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in sharded.parameters() if p.grad is not None),
        "saved_activation_bytes": saved.nbytes, "est_activation_bytes": est.activation_bytes,
        "est_grad_bytes": est.grad_bytes, "mesh": str(plan.mesh), "fallbacks": len(plan.fallbacks),
        **{f"formula_{k}": v for k, v in formula_bytes(plan).items()},
    }


def step_time(rank: int, world: int, cfg_kw: dict, b: int, s: int, steps: int, warmup: int) -> dict:
    """Forward + backward + AdamW step time: autoshard 1d and PyTorch's own
    ``parallelize_module`` (ColwiseParallel q/k/v/gate/up, RowwiseParallel o/down), same
    model, same batch, same process group, measured alternately in one run."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import warnings

    import autoshard

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    inputs = _batch(cfg_kw["vocab_size"], b, s)
    ours = autoshard.shard(_tiny_llama(cfg_kw), mode="1d", example_inputs=inputs)
    ref = _tiny_llama(cfg_kw)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tp_plan = {}
    for i in range(cfg_kw["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            tp_plan[f"{pre}.{n}"] = ColwiseParallel()
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            tp_plan[f"{pre}.{n}"] = RowwiseParallel()
    parallelize_module(ref, mesh, tp_plan)

    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-4)

    def one(m, opt):
        opt.zero_grad(set_to_none=True)
        loss = m(**inputs).loss
        loss.backward()
        opt.step()
        return loss

    for _ in range(warmup):
        one(ours, opt_ours)
        one(ref, opt_ref)
    times = {"autoshard": [], "dtensor": []}
    losses = {}
    for _ in range(steps):             # alternate, so drift in host load hits both alike
        for name, m, opt in (("autoshard", ours, opt_ours), ("dtensor", ref, opt_ref)):
            dist.barrier()
            t0 = time.perf_counter()
            loss = one(m, opt)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
            loss = loss.detach()
            losses[name] = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
    return {"times": times, "losses": losses,
            "ours_params": sum(p.numel() for p in ours.parameters()),
            "ref_local_params": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                    for p in ref.parameters())}


def setup_time(rank: int, world: int, cfg_kw: dict, b: int, s: int, cache: str) -> dict:
    """Seconds of ``autoshard.shard()`` on this rank: first launch (empty capture cache),
    second launch (the disk cache warm, the process's loaded programs forgotten), the same
    process sharding the model again (its loaded program reused), and PyTorch's ``parallelize_module`` on the same model
    (the hand-written 1d plan of :func:`step_time`). Each timed between barriers."""
    import os
    import time
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import autoshard

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ["AUTOSHARD_CACHE"] = cache
    inputs = _batch(cfg_kw["vocab_size"], b, s)
    from autoshard.launch.capture_share import forget_loaded

    out = {}
    for label in ("first", "warm", "again"):
        if label == "warm":
            forget_loaded()         # a second launch is a new process: only the disk cache is warm
        model = _tiny_llama(cfg_kw)
        dist.barrier()
        t0 = time.perf_counter()
        autoshard.shard(model, mode="1d", example_inputs=inputs)
        out[label] = time.perf_counter() - t0
    ref = _tiny_llama(cfg_kw)
    dist.barrier()
    t0 = time.perf_counter()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = {}
    for i in range(cfg_kw["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{pre}.{n}"] = ColwiseParallel()
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{pre}.{n}"] = RowwiseParallel()
    parallelize_module(ref, mesh, plan)
    out["parallelize_module"] = time.perf_counter() - t0
    return out


def _dtensor_llama(cfg_kw: dict, world: int, sequence_parallel: bool):
    """The tiny Llama under PyTorch's ``parallelize_module``: Colwise q/k/v/gate/up,
    Rowwise o/down; with ``sequence_parallel`` the torchtitan layout (embedding output
    and the Rowwise outputs Shard(1), ``SequenceParallel`` norms, the attention / MLP
    inputs gathered by ``PrepareModuleInput``, the LM head reading Shard(1))."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    ref = _tiny_llama(cfg_kw)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = {}
    if sequence_parallel:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        plan["model.norm"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    for i in range(cfg_kw["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{pre}.{n}"] = ColwiseParallel()
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{pre}.{n}"] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
        if sequence_parallel:
            plan[f"{pre}.input_layernorm"] = SequenceParallel()
            plan[f"{pre}.post_attention_layernorm"] = SequenceParallel()
            plan[f"{pre}.self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                          desired_input_kwarg_layouts={"hidden_states": Replicate()})
            plan[f"{pre}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    parallelize_module(ref, mesh, plan)
    return ref


def step_time_variants(rank: int, world: int, cfg_kw: dict, b: int, s: int, steps: int, warmup: int,
                       variants: list) -> dict:
    """Forward + backward + AdamW step time of several layouts of the same tiny Llama,
    same batch, same process group, timed alternately step by step. Variants:
    ``("autoshard", mode, dp, zero)`` or ``("dtensor", sequence_parallel)``; an
    autoshard variant with dp > 1 gives each replica its rows of the batch."""
    import warnings

    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard.training import train as T

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    inputs = _batch(cfg_kw["vocab_size"], b, s)
    # explicit positions: PyTorch's sequence-parallel Llama sees only its part of the sequence
    inputs_pos = {**inputs, "position_ids": torch.arange(s).expand(b, s)}
    runs = {}
    errors = {}
    for v in variants:
        label = "/".join(str(x) for x in v)
        try:
            if v[0] == "autoshard":
                _, mode, dp, zero = v
                rows = T.local_rows_for(dp, rank // (world // dp), inputs)
                m = autoshard.shard(_tiny_llama(cfg_kw), mode=mode, dp=dp, example_inputs=rows)
                opt = T.make_optimizer(m, lr=1e-4, steps=10 ** 6, zero=zero)[0]
                runs[label] = (m, opt, rows)
            else:
                m = _dtensor_llama(cfg_kw, world, v[1])
                runs[label] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4), inputs_pos if v[1] else inputs)
        except Exception as e:  # noqa: BLE001 - reported in the table
            errors[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

    def one(m, opt, x):
        opt.zero_grad(set_to_none=True)
        loss = m(**x).loss
        loss.backward()
        opt.step()
        return loss

    for label, (m, opt, x) in list(runs.items()):
        try:
            for _ in range(warmup):
                one(m, opt, x)
        except Exception as e:  # noqa: BLE001
            errors[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            del runs[label]
    times = {k: [] for k in runs}
    losses = {}
    for _ in range(steps):
        for label, (m, opt, x) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = one(m, opt, x)
            dist.barrier()
            times[label].append(time.perf_counter() - t0)
            loss = loss.detach()
            losses[label] = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
    from autoshard.training.zero import optimizer_state_bytes

    opt_bytes = {k: optimizer_state_bytes(opt) for k, (_, opt, _) in runs.items()}
    return {"times": times, "losses": losses, "errors": errors, "optimizer_bytes": opt_bytes}


def auto_choice(rank: int, world: int, cfg_kw: dict, b: int, s: int, steps: int, warmup: int,
                cands: list, profile_kw: dict) -> dict:
    """Every candidate layout of one world size, measured in one run: the cluster
    profiled first (:func:`autoshard.profile`, all ranks at once, as the layouts run),
    then each candidate sharded and timed (forward + backward + AdamW, ``steps`` after
    ``warmup``, each step between barriers) with the global batch ``b`` cut over its
    dp replicas; rank 0 also predicts each step with :func:`autoshard.planning.cost.estimate`."""
    import warnings

    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard.planning.cost import estimate

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    cluster = autoshard.profile(**profile_kw)
    full = _batch(cfg_kw["vocab_size"], b, s)
    out = {"cluster": cluster.to_dict(), "runs": []}
    for mode, depth, dp, label in cands:
        rows = b // dp
        replica = (rank // (world // dp)) if dp > 1 else 0
        inputs = {k: v[replica * rows:(replica + 1) * rows] for k, v in full.items()}
        model = _tiny_llama(cfg_kw)
        sharded = autoshard.shard(model, mode=mode, depth=depth, dp=dp, example_inputs=inputs)
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4)

        def one():
            opt.zero_grad(set_to_none=True)
            loss = sharded(**inputs).loss
            loss.backward()
            opt.step()

        for _ in range(warmup):
            one()
        times = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            one()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        est = estimate(sharded.plan, cluster) if rank == 0 else None
        out["runs"].append({"label": label, "mode": mode, "depth": depth, "dp": dp, "times": times,
                            "predicted_s": est.step_s if est else None,
                            "predicted": est.to_dict() if est else None})
    return out


def generate_time(rank: int, world: int, cfg_kw: dict, mode: str, depth, b: int, prompt: int, new: int,
                  reps: int, dtensor: bool) -> dict:
    """Per-token latency of greedy ``generate`` on one rank (the cluster profiled first,
    for the cost model's prediction): autoshard's sharded module
    (static sharded KV cache, step graphs), the dense model, and (``dtensor``) PyTorch's
    ``parallelize_module`` 1d on the same model, timed alternately ``reps`` times each.
    A run of ``new`` tokens minus a run of one token, over ``new - 1``: the prefill and
    the loop's set-up cancel. Also the tokens (equal to dense?) and this rank's KV-cache
    bytes against the decode plan's."""
    import copy

    import torch

    import autoshard
    from autoshard.planning.cost import forward_latency

    torch.set_num_threads(1)
    cluster = autoshard.profile()           # this machine's collectives and matmul, all ranks at once
    dense = _tiny_llama(cfg_kw).eval()
    ids = _batch(cfg_kw["vocab_size"], b, prompt)["input_ids"]
    mask = torch.ones_like(ids)
    mask[: b // 2, : prompt // 2] = 0           # left padding on half the rows
    sharded = autoshard.shard(copy.deepcopy(dense), mode=mode, depth=depth)
    ref = dense.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                         pad_token_id=0).tolist()
    models = {"autoshard": sharded, "dense": dense}
    if dtensor:
        models["parallelize_module"] = _dtensor_llama(cfg_kw, world, False).eval()
    tokens = {}
    times: dict = {k: [] for k in models}
    for i in range(reps + 1):
        for name, m in models.items():
            spans = []
            for n in (1, new):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=0)
                spans.append(time.perf_counter() - t0)
            tokens[name] = out.tolist()
            if i:           # the first round captures the step graphs
                times[name].append((spans[1] - spans[0]) / (new - 1))
    plan = sharded.generation_plan("decode")
    max_len = next(n.global_shape[2] for n in plan.nodes if n.kind == "state")
    keys, values = sharded._generator.cache(plan, b, max_len, sharded.device, sharded.dtype)
    return {"times": times, "equal": {k: v == ref for k, v in tokens.items()},
            "cache_bytes": sum(t.numel() * t.element_size() for t in keys + values),
            "plan_cache_bytes": plan.state_bytes_per_rank, "decode_calls": len(plan.comms("fwd")),
            "decode_bytes": plan.comm_bytes_per_rank("fwd"), "captures": sharded._generator.captures,
            "predicted_s": {"cpu-gloo": forward_latency(plan, "cpu-gloo"), "profiled": forward_latency(plan, cluster)}}


def overlap_time(rank: int, world: int, cfg_kw: dict, mode: str, dp: int, b: int, s: int, steps: int,
                 warmup: int, buckets: list, depth: int | None = None) -> dict:
    """Training-step time (forward + backward + AdamW) of one layout: every collective
    one after the other (``paired_collectives(False)``, gradient all-reduces one blocking
    call per parameter); a SUMMA / 3D Linear's two operand collectives in flight together
    (the default); that with each SUMMA / 3D weight gather launched one Linear early
    (``prefetch_weights()``); and paired with the gradient all-reduces in asynchronous buckets during
    backward (``overlap_grad_sync(bucket_bytes)``, each of ``buckets``). Same weights and
    batch, timed alternately step by step in one run."""
    import copy
    import warnings

    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard.runtime.collectives import CommLedger
    from autoshard.runtime.parallel_ops import paired_collectives

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    inputs = _replica_batch(cfg_kw, rank, world, dp, b, s)
    base = _tiny_llama(cfg_kw)
    runs = {}
    variants = [("sequential", False, False, None), ("paired", True, False, None), ("paired + prefetch", True, True, None)]
    for name, paired, prefetch, bucket in variants + [(f"paired + buckets {b:,} B", True, False, b) for b in buckets]:
        m = autoshard.shard(copy.deepcopy(base), mode=mode, dp=dp, depth=depth, example_inputs=inputs)
        m.prefetch_weights(prefetch)
        if bucket is not None:
            m.overlap_grad_sync(bucket_bytes=bucket)
        runs[name] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4), paired)

    def one(m, opt, paired):
        opt.zero_grad(set_to_none=True)
        with paired_collectives(paired):
            loss = m(**inputs).loss
            loss.backward()
        opt.step()
        return float(loss.detach())

    for _ in range(warmup):
        for run in runs.values():
            one(*run)
    times: dict = {k: [] for k in runs}
    calls = {}
    losses = {}
    for _ in range(steps):
        for name, run in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            with CommLedger() as led:
                losses[name] = one(*run)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
            calls[name] = led.count()
    return {"times": times, "calls": calls, "losses": losses}


#: ATen ops counted as matmul compute in a step's breakdown (self time)
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm",
                        "aten::_scaled_dot_product_flash_attention_for_cpu",
                        "aten::_scaled_dot_product_flash_attention_for_cpu_backward"})


def step_breakdown(prof, step_s: float, opt_s: float) -> dict:
    """One profiled step split by job (seconds): matmul compute (the ops of
    :data:`MATMUL_OPS`, attention's fused kernel included), other compute (every other
    ATen op outside the collectives and the optimizer: norms, rotary, residuals, loss,
    copies), collectives (wall time of autoshard's collective ops, waits included),
    optimizer (``opt.step``, timed around it), and the rest of the step's wall time:
    framework overhead (Python, dispatch, autograd bookkeeping, custom-op glue)."""
    events = [e for e in prof.events() if e.device_type.name == "CPU"]

    def inside(e, pred) -> bool:
        p = e.cpu_parent
        while p is not None:
            if pred(p):
                return True
            p = p.cpu_parent
        return False

    def is_comm(e):
        return e.name.startswith("autoshard::")

    def is_opt(e):
        return e.name.startswith("Optimizer.step")

    out = {"matmul": 0.0, "other_compute": 0.0, "collectives": 0.0}
    for e in events:
        if is_comm(e) and not inside(e, is_comm):
            out["collectives"] += e.cpu_time_total / 1e6
        elif e.name.startswith("aten::") and not inside(e, lambda p: is_comm(p) or is_opt(p)):
            out["matmul" if e.name in MATMUL_OPS else "other_compute"] += e.self_cpu_time_total / 1e6
    out["optimizer"] = opt_s
    out["overhead"] = max(step_s - sum(out.values()), 0.0)
    out["step"] = step_s
    return out


def efficiency(rank: int, world: int, cfg_kw: dict, b: int, s: int, steps: int, warmup: int,
               modes: list, async_tp: int = 1, gather_logits: bool = True) -> dict:
    """TP efficiency on this pool: the dense model on one thread (rank 0; the others
    wait) and each mode of ``modes`` on every rank, one thread each, timed step by step
    alternately (forward + backward + AdamW); then one profiled step of each for the
    breakdown (:func:`step_breakdown`). ``async_tp > 1``: 1d and 1d-sp run once more with
    ``sharded.async_tp(async_tp)``; ``gather_logits``: as :func:`autoshard.shard`'s."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import warnings

    import autoshard

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    inputs = _batch(cfg_kw["vocab_size"], b, s)
    runs = {"dense": _tiny_llama(cfg_kw)} if rank == 0 else {}
    errors = {}
    for mode in modes:
        try:
            runs[mode] = autoshard.shard(_tiny_llama(cfg_kw), mode=mode, example_inputs=inputs,
                                         gather_logits=gather_logits)
        except autoshard.AutoshardError as e:        # raised alike on every rank, before any collective
            errors[mode] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    extra = []
    for mode in ("1d", "1d-sp") if async_tp > 1 else ():
        if mode in runs:
            extra.append(f"{mode} async_tp({async_tp})")
            runs[extra[-1]] = autoshard.shard(_tiny_llama(cfg_kw), mode=mode, example_inputs=inputs,
                                              gather_logits=gather_logits).async_tp(async_tp)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in runs.items()}

    def one(name):
        m, opt = runs[name], opts[name]
        opt.zero_grad(set_to_none=True)
        loss = m(**inputs).loss
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        return loss, time.perf_counter() - t0

    names = ["dense"] + [m for m in modes if m not in errors] + extra
    times = {n: [] for n in names}
    losses = {}
    for i in range(warmup + steps):          # alternate, so drift in host load hits every run alike
        for name in names:
            dist.barrier()
            t0 = time.perf_counter()
            if name in runs:
                loss, _ = one(name)
                losses[name] = float(loss.detach())
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    breakdown = {}
    for name in names:
        dist.barrier()
        if name not in runs:
            dist.barrier()
            continue
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            _, opt_s = one(name)
            step_s = time.perf_counter() - t0
        dist.barrier()
        breakdown[name] = step_breakdown(prof, step_s, opt_s)
    return {"times": times, "losses": losses, "breakdown": breakdown, "errors": errors}


def zero_vs_fsdp(rank: int, world: int, cfg_kw: dict, mode: str, dp: int, b: int, s: int, steps: int,
                 warmup: int) -> dict:
    """Training-step time (forward + backward + AdamW, 1 micro-batch) and bytes per rank of
    the same layout with its data-parallel memory handled four ways: plain AdamW
    (every replica holds everything), ZeRO-1, ZeRO-2 (autoshard.training.zero) and FSDP2
    over dp (``fsdp=True``). Bytes: parameters at rest, gradients after backward (what
    the optimizer reads: ZeRO-2's chunks, FSDP's reduce-scattered shards) and the
    optimizer state after a step. Same weights and batch; runs timed alternately."""
    import copy
    import warnings

    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard.training import train as T
    from autoshard.training.zero import optimizer_state_bytes

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    inputs = _replica_batch(cfg_kw, rank, world, dp, b, s)
    base = _tiny_llama(cfg_kw)

    def nbytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    runs = {}
    for name, zero, fsdp in (("plain AdamW", 0, False), ("ZeRO-1", 1, False), ("ZeRO-2", 2, False),
                             ("FSDP2", 0, True)):
        m = autoshard.shard(copy.deepcopy(base), mode=mode, dp=dp, example_inputs=inputs, fsdp=fsdp)
        opt, _ = T.make_optimizer(m, lr=1e-4, steps=steps + warmup, zero=zero)
        runs[name] = (m, opt)

    def one(m, opt):
        opt.zero_grad(set_to_none=True)
        loss = m(**inputs).loss
        loss.backward()
        grads = sum(nbytes(p.grad) for p in m.parameters() if p.grad is not None)
        grads += sum(nbytes(g) for g in getattr(opt, "_gshard", []) if g is not None)
        opt.step()
        return float(loss.detach()), grads

    times: dict = {k: [] for k in runs}
    out = {k: {} for k in runs}
    for i in range(warmup + steps):
        for name, (m, opt) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss, grads = one(m, opt)
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
            out[name] = {"loss": loss, "grad_bytes": grads}
    for name, (m, opt) in runs.items():
        out[name]["param_bytes"] = sum(nbytes(p) for p in m.parameters())
        out[name]["optimizer_bytes"] = optimizer_state_bytes(opt)
    dense = sum(p.numel() * p.element_size() for p in base.parameters())
    return {"times": times, "bytes": out, "dense_param_bytes": dense}


def context_parallel(rank: int, world: int, cfg_kw: dict, b: int, seqs: list, cps: list, steps: int,
                     warmup: int) -> dict:
    """Per sequence length, ``cp`` (world = cp × tp, mode 1d) and attention (ring in the balanced and in the
    contiguous order, gather): the bytes this rank saves for backward in one forward (measured with
    ``saved_tensors_hooks``) and the plan's prediction of them, the attention scores the ring computed
    on this rank, and training-step times (forward + backward + AdamW), the cp layouts of one length
    timed alternately step by step."""
    import copy
    import warnings

    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard.planning.activations import SavedBytes, saved_bytes
    from autoshard.runtime.parallel_ops import ring_work

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    base = _tiny_llama(cfg_kw)
    out = {"times": {}, "bytes": {}}
    for s in seqs:
        inputs = _batch(cfg_kw["vocab_size"], b, s)
        runs = {}
        for cp in cps:
            for att, order in (("ring", "balanced"), ("ring", "contiguous"), ("gather", "balanced")) if cp > 1 \
                    else (("ring", "balanced"),):
                m = autoshard.shard(copy.deepcopy(base), mode="1d", cp=cp, cp_attention=att, cp_order=order,
                                    example_inputs=inputs)
                with SavedBytes(m.parameters()) as sv, ring_work() as work:
                    m(**inputs).loss.backward()
                m.zero_grad(set_to_none=True)
                key = f"{s}:{cp}:{att}:{order}"
                out["bytes"][key] = {"measured": sv.nbytes, "predicted": saved_bytes(m.plan, "cpu"),
                                     "scores": work["scores"]}
                runs[key] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4))
        for key in runs:
            out["times"][key] = []
        for i in range(warmup + steps):
            for key, (m, opt) in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                m(**inputs).loss.backward()
                opt.step()
                dist.barrier()
                if i >= warmup:
                    out["times"][key].append(time.perf_counter() - t0)
        del runs
    return out


def compile_cold(rank: int, world: int, name: str, mode: str | None, path: str, backend: str) -> dict:
    """Cold ``torch.compile`` of one path on this pool (a fresh process, a fresh inductor
    cache): ``dense`` (rank 0 compiles the dense model; the other ranks wait),
    ``method`` (``sharded.compile()``: once per host where the host's ranks outnumber
    its cores), ``method-each`` (``sharded.compile(once_per_host=False)``: every rank at
    once) or ``module`` (``torch.compile(sharded)``, what users write). The sharded module runs one eager step first (capture, launch and the first
    call's self-check are not compile time). Returns the first two compiled steps'
    times (forward + backward; the first compiles) and dynamo's graph, break and
    recompile counts."""
    import copy

    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import warnings

    import autoshard
    import models

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dense = models.build(name)
    inputs = models.batch(name)
    if path == "dense":
        m = torch.compile(dense, backend=backend) if rank == 0 else None
    else:
        sharded = autoshard.shard(copy.deepcopy(dense), mode=mode, example_inputs=inputs)
        sharded(**inputs).loss.backward()
        sharded.zero_grad(set_to_none=True)
        if path in ("method", "method-each"):        # method: compiled once per host where it pays
            sharded.compile(backend=backend, once_per_host=False if path == "method-each" else None)
            m = sharded
        else:
            m = torch.compile(sharded, backend=backend)
    counters.clear()
    times = []
    for _ in range(2):
        dist.barrier()
        t0 = time.perf_counter()
        if m is not None:
            m(**inputs).loss.backward()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    return {"times": times, "graphs": int(counters["stats"]["unique_graphs"]),
            "cache_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "cache_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
            "breaks": int(sum(counters["graph_break"].values())),
            "break_reasons": sorted(k.splitlines()[0] for k in counters["graph_break"]),
            "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0}


def async_tp_primitive(rank: int, world: int, rows: int, ks: list, n: int, chunks: list, steps: int,
                       warmup: int) -> dict:
    """The row-parallel Linear's forward (local ``[rows, k] @ [k, n]`` partial product, sum
    all-reduce over the ranks) as autoshard runs it (one product, one blocking all-reduce)
    and micro-pipelined (the rows in ``c`` chunks, each chunk's all-reduce launched
    asynchronously while the next chunk multiplies), timed alternately per ``k``; the
    largest difference from the plain result is returned too."""
    import statistics

    import torch
    import torch.distributed as dist

    from autoshard.runtime import collectives as C

    torch.set_num_threads(1)
    group = dist.group.WORLD.group_name
    out = {}
    for k in ks:
        g = torch.Generator().manual_seed(rank)
        x, w = torch.randn(rows, k, generator=g), torch.randn(k, n, generator=g)

        def plain():
            return C.all_reduce(x @ w, group, "sum")

        def chunked(c):
            y = torch.empty(rows, n)
            works = []
            for part_x, part_y in zip(x.tensor_split(c), y.tensor_split(c)):
                torch.mm(part_x, w, out=part_y)
                works.append(C.all_reduce_async(part_y, group))
            for wk in works:
                wk.wait()
            return y

        runs = {"plain": plain, **{f"chunks={c}": (lambda c=c: chunked(c)) for c in chunks}}
        ref = plain()
        err = max(float((f() - ref).abs().max()) for f in runs.values())
        times = {name: [] for name in runs}
        for i in range(warmup + steps):
            for name, f in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                f()
                dt = time.perf_counter() - t0
                if i >= warmup:
                    times[name].append(dt)
        out[k] = {"times": times, "max_abs_diff": err,
                  "median": {name: statistics.median(ts) for name, ts in times.items()}}
    return out


def async_tp_step(rank: int, world: int, cfg_kw: dict, b: int, s: int, chunks: list, steps: int,
                  warmup: int) -> dict:
    """A 1d training step (forward + backward + AdamW) plain and with
    ``sharded.async_tp(c)`` for each ``c`` of ``chunks``: one module per variant, the same
    weights and batch, timed alternately step by step; their losses too."""
    import torch
    import torch.distributed as dist

    import warnings

    import autoshard

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    inputs = _batch(cfg_kw["vocab_size"], b, s)
    runs = {"plain": autoshard.shard(_tiny_llama(cfg_kw), mode="1d", example_inputs=inputs)}
    for c in chunks:
        runs[f"async_tp({c})"] = autoshard.shard(_tiny_llama(cfg_kw), mode="1d", example_inputs=inputs).async_tp(c)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in runs.items()}
    times = {k: [] for k in runs}
    losses = {}
    for i in range(warmup + steps):
        for name, m in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            opts[name].zero_grad(set_to_none=True)
            loss = m(**inputs).loss
            loss.backward()
            opts[name].step()
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
            if i == 0:
                losses[name] = float(loss.detach())
    return {"times": times, "losses": losses}


def collectives_transport(rank: int, world: int, sizes: list, steps: int, warmup: int) -> dict:
    """Per size (bytes of fp32 per rank) and collective (all-reduce, all-gather and
    reduce-scatter on the last dim, as autoshard's kernels issue them): seconds of the
    call on the process group (gloo) and on the shared-memory transport
    (:mod:`autoshard.runtime.shm`), alternately, each after a barrier; and whether the
    two gave the same tensor."""
    import os

    import torch
    import torch.distributed as dist

    from autoshard.runtime import collectives as C

    torch.set_num_threads(1)
    group = dist.new_group(list(range(world))).group_name
    calls = {"all_reduce": lambda x: C.all_reduce(x, group, "sum"),
             "all_gather": lambda x: C.all_gather(x, x.dim() - 1, group),
             "reduce_scatter": lambda x: C.reduce_scatter(x, x.dim() - 1, group)}
    out = {}
    for nbytes in sizes:
        x = torch.randn(8, nbytes // 4 // 8, generator=torch.Generator().manual_seed(rank))
        for kind, f in calls.items():
            times = {"gloo": [], "shm": []}
            res = {}
            for i in range(warmup + steps):
                for transport in times:
                    os.environ["AUTOSHARD_SHM"] = "0" if transport == "gloo" else "1"
                    dist.barrier()
                    t0 = time.perf_counter()
                    res[transport] = f(x)
                    if i >= warmup:
                        times[transport].append(time.perf_counter() - t0)
            os.environ.pop("AUTOSHARD_SHM")
            out[(nbytes, kind)] = {"times": times,
                                   "max_abs_diff": float((res["gloo"] - res["shm"]).abs().max())}
    return out
