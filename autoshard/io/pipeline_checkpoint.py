"""The sharded checkpoint format (:mod:`autoshard.io.sharded_format`) written and read per
pipeline stage (a module sharded with ``pp > 1``: :mod:`autoshard.pipeline_parallel`).

Every rank writes its stages' blocks into its own ``rank-XXXXX-of-YYYYY.safetensors``,
nothing gathered. The manifest is the one :func:`~autoshard.io.sharded_format.save_checkpoint`
writes, with the mesh of one stage's block of ranks (every stage has the same layout on
it): a block's ``rank`` is its place in that mesh, its ``file`` the file of the rank of
the stage holding it. A tensor read on stages of two pipeline ranks (a tied embedding
and head) is written once, by the lower. So the folder loads as any checkpoint does:
:func:`autoshard.load_checkpoint` in any mode and world size, ``export_checkpoint`` to a
Hugging Face folder for dense transformers, and :func:`load_pipeline_checkpoint` into a
module of any ``pp`` (each rank reads its stages' tensors, sliced to its block).

    autoshard.save_checkpoint(sharded, "ckpt", optimizer=opt)        # sharded with pp=2
    again = autoshard.shard(model, mode="1d", pp=4, example_inputs=mb)
    load_pipeline_checkpoint(again, "ckpt", optimizer=opt4)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ..ir.errors import CheckpointError
from ..ir.spec import replicated
from ..runtime.collectives import entry_barrier
from .builder import with_architecture
from .safetensors_io import StreamWriter, write_atomic
from .sharded_format import (FORMAT, MANIFEST, VERSION, Saved, decode_value, encode_value, rank_file, read_manifest,
                             verify_checkpoint)

__all__ = ["save_pipeline_checkpoint", "load_pipeline_checkpoint"]

_OPT = "optim/"


def _writers(module) -> dict[str, int]:
    """Each parameter this module's plan holds -> the lowest pipeline rank whose stages read it."""
    by_name = {n: q.name for q in module.plan.params for n in (q.name, *q.aliases)}
    out: dict[str, int] = {}
    for st in module._all_stages:
        for t in st.tensors:
            if t in by_name:
                name, r = by_name[t], module.owners[st.index]
                out[name] = min(out.get(name, r), r)
    return out


def _rows(module, optimizer) -> tuple[list, dict]:
    """``(key, meta, local tensor)`` for every tensor this rank writes (its block of its
    stages' parameters and optimizer state), and its optimizer's JSON part."""
    params = dict(module.named_parameters(remove_duplicate=False))
    writers, me = _writers(module), module.local_rank
    rows, groups, extra = [], [], {}
    state = {id(p): optimizer.state.get(p, {}) for p in params.values()} if optimizer is not None else {}
    for q in module.plan.params:
        p = params.get(q.name)
        if p is None:
            continue
        items = [(q.name, "param", None, p.detach(), q.spec, tuple(q.global_shape))]
        for k, v in state.get(id(p), {}).items():
            if not isinstance(v, torch.Tensor):
                extra.setdefault(q.name, {})[k] = encode_value(v)
            elif v.dim() and tuple(v.shape) == tuple(p.shape):
                items.append((f"{_OPT}{q.name}/{k}", "optim", k, v.detach(), q.spec, tuple(q.global_shape)))
            else:
                items.append((f"{_OPT}{q.name}/{k}", "optim", k, v.detach(), replicated(v.dim()), tuple(v.shape)))
        for key, kind, k, t, spec, gshape in items:
            if writers.get(q.name) != module.pp_rank or spec.owner(module.mesh, me) != me:
                continue        # another pipeline rank or another place of the stage writes this block
            # as save_checkpoint: a padded vocabulary assembles to gshape, Hugging Face holds dense
            dense = tuple(q.hf_shape) if gshape == tuple(q.global_shape) else gshape
            meta = {"kind": kind, "param": q.name, "state_key": k, "global_shape": list(gshape),
                    "dense_shape": list(dense), "dtype": str(t.dtype).removeprefix("torch."),
                    "spec": spec.to_dict(), "aliases": list(q.aliases) if kind == "param" else [],
                    **({"pad_segments": q.pad_segments, "pad_copies": q.pad_copies}
                       if (q.pad_segments != 1 or q.pad_copies) and dense != gshape else {}),
                    **({"pad_extra": list(q.pad_extra)} if q.pad_extra and dense != gshape else {})}
            rows.append((key, meta, t))
    if optimizer is not None:
        name_of = {id(params[q.name]): q.name for q in module.plan.params if q.name in params}
        for group in optimizer.param_groups:
            groups.append({**{k: encode_value(v) for k, v in group.items() if k != "params"},
                           "params": [name_of[id(p)] for p in group["params"] if id(p) in name_of]})
    return rows, {"class": type(optimizer).__name__, "param_groups": groups, "extra_state": extra}


def _manifest(module, reports: list, config) -> dict:
    """The manifest from every rank's report (rank 0)."""
    tensors: dict = {}
    for rep in reports:
        for key, meta in rep["meta"].items():
            ent = tensors.setdefault(key, {**meta, "blocks": []})
            b = rep["blocks"][key]
            ent["blocks"].append({"rank": rep["rank"] % module.mesh.world_size, "file": rep["file"],
                                  "offsets": b["offsets"], "sha256": b["sha256"]})
    groups: list = []
    extra: dict = {}
    for rep in reports:         # each rank's optimizer holds its stages' parameters: the groups merged by index
        opt = rep["optimizer"]
        if opt is None:
            continue
        extra.update(opt["extra_state"])
        for i, g in enumerate(opt["param_groups"]):
            if i == len(groups):
                groups.append({**g, "params": []})
            groups[i]["params"] += [n for n in g["params"] if n not in groups[i]["params"]]
    order = {q.name: i for i, q in enumerate(module.plan.params)}
    for g in groups:
        g["params"].sort(key=lambda n: order.get(n, len(order)))
    first = next((r["optimizer"] for r in reports if r["optimizer"] is not None), None)
    opt_json = None if first is None else {"class": first["class"], "param_groups": groups, "extra_state": extra}
    return {"format": FORMAT, "version": VERSION, "model": module.plan.model, "mode": module.plan.mode,
            "mesh": module.mesh.to_dict(), "world_size": dist.get_world_size(), "pp": module.pp,
            "plan_fingerprint": module.plan.fingerprint(), "config": "config.json" if config is not None else None,
            "files": {r["file"]: {"rank": r["rank"], "size": r["size"], "sha256": r["sha256"]} for r in reports},
            "tensors": tensors, "optimizer": opt_json, "complete": True}


def save_pipeline_checkpoint(module, path, optimizer=None, *, config=None) -> None:
    """Write ``module``'s checkpoint (see the module doc): collective, call on every rank.
    :func:`autoshard.save_checkpoint` calls it for a pipeline-parallel module."""
    rank, world = dist.get_rank(), dist.get_world_size()
    entry_barrier("save_checkpoint")
    path = Path(path)
    config = config if config is not None else getattr(module, "config", None)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / MANIFEST).unlink(missing_ok=True)       # an old manifest must not bless new files
    dist.barrier()
    rows, opt_json = _rows(module, optimizer)
    fname = rank_file(rank, world)
    writer = StreamWriter(path / fname, [(k, tuple(t.shape), t.dtype) for k, _, t in rows],
                          metadata={"autoshard": f"rank {rank} of {world}, pipeline rank {module.pp_rank}"})
    try:
        for k, _, t in rows:
            writer.write(k, t)
        size, sha = writer.commit()
    except BaseException:
        writer.abort()
        raise
    report = {"file": fname, "rank": rank, "size": size, "sha256": sha, "meta": {k: m for k, m, _ in rows},
              "blocks": {k: {"offsets": list(writer.offsets[k]), "sha256": writer.tensor_sha[k]} for k in writer.order},
              "optimizer": opt_json if optimizer is not None else None}
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        if config is not None:
            with_architecture(config, module.plan.model).save_pretrained(str(path))
        write_atomic(path / MANIFEST, json.dumps(_manifest(module, reports, config), indent=1))
    dist.barrier()


def load_pipeline_checkpoint(module, path, optimizer=None, *, verify: bool = True) -> None:
    """Fill a pipeline-parallel ``module`` (any ``pp``, mode of the same stage layout or
    another) from a checkpoint saved at any pp or without one: each rank reads its stages'
    tensors, sliced to its block; with ``optimizer`` (built over ``module.parameters()``)
    its state too. No collective."""
    path = Path(path)
    man = read_manifest(path)
    if verify:
        verify_checkpoint(path, man)
    saved = Saved(path, man)
    params = dict(module.named_parameters(remove_duplicate=False))
    for q in module.plan.params:
        p = params.get(q.name)
        if p is None:
            continue
        key = next((saved.by_name[n] for n in (q.name, *q.aliases) if n in saved.by_name), None)
        if key is None:
            raise CheckpointError(f"{path}: no tensor {q.name!r} (nor its aliases {list(q.aliases)}) in the checkpoint")
        with torch.no_grad():
            p.copy_(saved.local(key, q.spec, module.mesh, module.local_rank, p.dtype, shape=q.global_shape,
                                segments=q.pad_segments, copies=q.pad_copies, extra=q.pad_extra))
        if optimizer is not None:
            _load_state(optimizer, p, q, man, saved, module)
    saved.files.close()


def _load_state(optimizer, p, q, man: dict, saved: Saved, module) -> None:
    """``optimizer``'s state of parameter ``p`` (plan ``q``) from the checkpoint."""
    entry = {}
    prefix = f"{_OPT}{q.name}/"
    for key, ent in man["tensors"].items():
        if ent["kind"] == "optim" and key.startswith(prefix):
            k = ent["state_key"]
            if tuple(ent["global_shape"]) == tuple(q.global_shape):
                v = saved.local(key, q.spec, module.mesh, module.local_rank, p.dtype, shape=q.global_shape,
                                segments=q.pad_segments, copies=q.pad_copies, extra=q.pad_extra)
            else:
                v = saved.local(key, replicated(len(ent["global_shape"])), module.mesh, module.local_rank,
                                getattr(torch, ent["dtype"]))
            entry[k] = v.to(p.device)
    for k, v in ((man.get("optimizer") or {}).get("extra_state") or {}).get(q.name, {}).items():
        entry[k] = decode_value(v)
    if entry:
        optimizer.state[p] = entry
