"""The sharded checkpoint format: one safetensors file per rank plus a manifest,
loadable onto any mode and world size.

:func:`save_checkpoint` writes it; :func:`read_manifest` / :func:`verify_checkpoint`
check it; :class:`Saved` reads a tensor back, whole or as one rank's part of
another mesh; :func:`fill_from_checkpoint` and :func:`load_optimizer` fill a newly
sharded module and its optimizer (the face, :func:`autoshard.load_checkpoint`,
lives in :mod:`autoshard.load`).

Why not ``torch.distributed.checkpoint`` (docs/design.md, "Checkpoints")
------------------------------------------------------------------------
DCP assumes that a rank's piece of a tensor is one rectangular chunk with global
offsets. Ours is not always: a fused dim (GPT-2 ``c_attn``: q, k, v, or any
``segments`` > 1) split over ``p`` ranks gives each rank ``segments`` disjoint
blocks, and a dim split over two mesh axes has its own interleaving. Expressing
that needs DCP's private chunk protocol (``__create_write_items__`` /
``__create_chunk_list__`` / ``__get_tensor_shard__``) on a tensor subclass of our
own, plus a consolidation step for HF. The integrity checks we owe (file *and
tensor* named on a missing manifest, a truncated file, a flipped byte, another
model) sit above DCP anyway. So the format here is small and explicit:

* ``rank-XXXXX-of-YYYYY.safetensors``, one per rank, holding that rank's local
  tensors under their HF names and optimizer state as ``optim/<name>/<key>``.
  Replicated blocks are written once (by the lowest rank that holds them), as
  DCP's dedup would.
* ``manifest.json``: format version, model, mode, mesh, plan fingerprint, per
  tensor the global shape, dtype, :class:`~autoshard.ir.spec.ShardSpec`
  (``to_dict``), aliases and, for each distinct block, the rank whose
  coordinates define it, the file, byte offsets and sha256; per file its size
  and sha256; the optimizer's param groups and non-tensor state.
* Every file is written to ``<name>.tmp``, fsync'd and renamed; the manifest is
  written by rank 0 *last*, after every rank reported its hashes, and an older
  manifest is deleted before anything else is written. No manifest = no
  checkpoint.

Loading onto another mesh reads, tensor by tensor, the saved blocks, places them
into the dense tensor (one tensor at a time, never the whole model) and slices the
new local part; when the saved mesh and spec equal the new ones a rank reads its
own block only. Files are verified (size, sha256) before any model is built, and
the manifest's tensor names and shapes are checked against the model before any
collective, so every rank raises the same :class:`~autoshard.ir.errors.CheckpointError`.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from torch import nn

from .builder import Built, with_architecture
from ..runtime.collectives import entry_barrier
from ..ir.errors import CheckpointError, ConfigError
from .hf_fill import fill_buffers, set_param
from ..ir.log import progress as _progress_bar
from ..ir.log import show_progress
from ..ir.mesh import Mesh
from ..ir.plan import ParamPlan
from .safetensors_io import LazyFiles, StreamWriter, read_local, write_atomic
from ..ir.spec import ShardSpec, replicated

__all__ = ["checkpoint_class", "save_checkpoint", "read_manifest", "verify_checkpoint", "check_matches", "Saved",
           "fill_from_checkpoint", "load_optimizer", "MANIFEST", "FORMAT", "VERSION"]

MANIFEST = "manifest.json"
FORMAT = "autoshard-checkpoint"
VERSION = 1
_OPT_PREFIX = "optim/"


def rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def encode_value(v):
    if isinstance(v, tuple):
        return {"__tuple__": [encode_value(x) for x in v]}
    if isinstance(v, list):
        return [encode_value(x) for x in v]
    if isinstance(v, dict):
        return {k: encode_value(x) for k, x in v.items()}
    if isinstance(v, torch.Tensor):
        return {"__tensor__": v.detach().cpu().tolist(), "dtype": str(v.dtype).removeprefix("torch.")}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise CheckpointError(f"cannot store optimizer value {v!r} of type {type(v).__name__} in the manifest")


def decode_value(v):
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if isinstance(v, dict):
        if "__tuple__" in v:
            return tuple(decode_value(x) for x in v["__tuple__"])
        if "__tensor__" in v:
            return torch.tensor(v["__tensor__"], dtype=getattr(torch, v["dtype"]), device="cpu")
        return {k: decode_value(x) for k, x in v.items()}
    return v


def _optimizer_items(sharded, optimizer):
    """``(file key, param plan, state key, local tensor, spec, global shape)`` for
    every tensor of the optimizer state, and the JSON part (param groups by name,
    non-tensor state)."""
    params = dict(sharded.named_parameters(remove_duplicate=False))
    plan = {pp.name: pp for pp in sharded.plan.params}
    name_of = {id(params[n]): n for n in plan}
    items, groups, extra = [], [], {}
    for gi, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            if id(p) not in name_of:
                raise ConfigError(f"optimizer param group {gi} holds a tensor that is not a parameter of this "
                                  f"sharded module (build the optimizer over sharded.parameters())")
            name = name_of[id(p)]
            names.append(name)
            pp = plan[name]
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    if tuple(v.shape) == tuple(p.shape) and v.dim() > 0:
                        spec, gshape = pp.spec, tuple(pp.global_shape)
                    elif v.numel() <= 1:
                        spec, gshape = replicated(v.dim()), tuple(v.shape)
                    else:
                        raise CheckpointError(f"optimizer state {k!r} of {name!r} has shape {list(v.shape)}, "
                                              f"neither the parameter's local shape {list(p.shape)} nor a "
                                              f"scalar: cannot reshard it")
                    items.append((f"{_OPT_PREFIX}{name}/{k}", name, k, v.detach(), spec, gshape))
                else:
                    extra.setdefault(name, {})[k] = encode_value(v)
        groups.append({**{k: encode_value(v) for k, v in group.items() if k != "params"}, "params": names})
    return items, {"class": type(optimizer).__name__, "param_groups": groups, "extra_state": extra}


def save_checkpoint(sharded, path, optimizer=None, *, config=None) -> None:
    """Write a sharded checkpoint (one safetensors file per rank + ``manifest.json``).

    Call on every rank. ``optimizer``: one built over ``sharded.parameters()``, or
    a :class:`~autoshard.training.zero.ZeroAdamW` (its state gathered over dp first);
    its tensor state (shaped like the parameter, or scalars such as ``step``) is
    stored with the parameter's layout, its param groups in the manifest. The
    module's config (or ``config=``) is written as ``config.json`` so
    :func:`load_checkpoint` can rebuild the model from the folder alone."""
    import torch.distributed as dist

    if getattr(sharded, "pipelined", False):        # pp > 1: written per stage (io/pipeline_checkpoint.py)
        return sharded.save_checkpoint(path, optimizer, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    plan, mesh = sharded.plan, sharded.mesh
    if mesh.world_size != world:
        raise ConfigError(f"the module's mesh has {mesh.world_size} ranks, the process group {world}")
    if sharded.fsdp:
        raise ConfigError("save_checkpoint: this module's parameters are FSDP2 DTensors (fsdp=True), which our "
                          "per-rank format does not hold; save it with autoshard.io.dcp.save(sharded, path, "
                          "optimizer=opt) (DCP, loads in any mode) or save_pretrained (dense)")
    entry_barrier("save_checkpoint")
    if optimizer is not None and hasattr(optimizer, "gathered"):
        optimizer = optimizer.gathered()    # ZeRO (autoshard.training.zero): the whole TP-local state, any dp can resume
    path = Path(path)
    config = config if config is not None else getattr(sharded, "config", None)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / MANIFEST).unlink(missing_ok=True)       # an old manifest must not bless new files
    dist.barrier()

    params = dict(sharded.named_parameters(remove_duplicate=False))
    rows = []   # (key, kind, param name, state key, spec, global shape, dtype, aliases, local or None)
    for pp in plan.params:
        t = params[pp.name].detach()
        rows.append((pp.name, "param", pp.name, None, pp.spec, tuple(pp.global_shape), t.dtype,
                     tuple(pp.aliases), t))
    opt_json = None
    if optimizer is not None:
        items, opt_json = _optimizer_items(sharded, optimizer)
        for key, name, k, v, spec, gshape in items:
            rows.append((key, "optim", name, k, spec, gshape, v.dtype, (), v))
    mine = [r for r in rows if r[4].owner(mesh, rank) == rank]
    fname = rank_file(rank, world)
    writer = StreamWriter(path / fname, [(r[0], tuple(r[8].shape), r[6]) for r in mine],
                           metadata={"autoshard": f"rank {rank} of {world}"})
    try:
        for r in mine:
            writer.write(r[0], r[8])
        size, sha = writer.commit()
    except BaseException:
        writer.abort()
        raise
    report = {"file": fname, "rank": rank, "size": size, "sha256": sha,
              "blocks": {k: {"offsets": list(writer.offsets[k]), "sha256": writer.tensor_sha[k]}
                         for k in writer.order}}
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        if config is not None:
            with_architecture(config, plan.model).save_pretrained(str(path))
        adapters = getattr(sharded, "adapters", None)
        if adapters is not None:        # peft adapters (autoshard.adapters): export merges them
            adapters.write_configs(path)
        tensors = _manifest_tensors(rows, plan, mesh, reports)
        manifest = {"format": FORMAT, "version": VERSION, "model": plan.model, "mode": plan.mode,
                    "mesh": mesh.to_dict(), "world_size": world, "plan_fingerprint": plan.fingerprint(),
                    "config": "config.json" if config is not None else None,
                    "files": {rep["file"]: {"rank": rep["rank"], "size": rep["size"], "sha256": rep["sha256"]}
                              for rep in reports},
                    "tensors": tensors, "optimizer": opt_json, "complete": True}
        write_atomic(path / MANIFEST, json.dumps(manifest, indent=1))
    dist.barrier()


def _manifest_tensors(rows: list, plan, mesh, reports: list) -> dict:
    """The manifest's ``tensors`` table: for each row :func:`save_checkpoint` wrote, its
    kind, shapes, dtype, spec and aliases, and where each owner rank's block lies (file,
    byte offsets, hash: from the ranks' ``reports``)."""
    by_rank = {rep["rank"]: rep for rep in reports}
    tensors = {}
    by_name = {pp.name: pp for pp in plan.params}
    for key, kind, name, k, spec, gshape, dtype, aliases, _ in rows:
        pp = by_name[name]
        # a padded vocabulary: blocks assemble to gshape, Hugging Face holds dense_shape
        dense = pp.hf_shape if tuple(gshape) == tuple(pp.global_shape) else tuple(gshape)
        blocks = []
        for o in spec.owners(mesh):
            rep = by_rank[o]
            b = rep["blocks"][key]
            blocks.append({"rank": o, "file": rep["file"], "offsets": b["offsets"], "sha256": b["sha256"]})
        tensors[key] = {"kind": kind, "param": name, "state_key": k, "global_shape": list(gshape),
                        "dense_shape": list(dense),
                        **({"pad_segments": pp.pad_segments, "pad_copies": pp.pad_copies}
                           if (pp.pad_segments != 1 or pp.pad_copies) and dense != tuple(gshape) else {}),
                        **({"pad_extra": list(pp.pad_extra)} if pp.pad_extra and dense != tuple(gshape) else {}),
                        "dtype": str(dtype).removeprefix("torch."), "spec": spec.to_dict(),
                        "aliases": list(aliases), "blocks": blocks}
    return tensors


def checkpoint_class(man: dict, model_class=None, config=None):
    """The class a checkpoint was sharded from: ``model_class`` if given, else the
    manifest's model name when transformers has it and it takes ``config``'s kind,
    else None (the config's ``architectures`` decide)."""
    import transformers

    if model_class is not None:
        return model_class
    name = man.get("model")
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    want = getattr(cls, "config_class", None)
    if cls is None or (config is not None and isinstance(want, type) and not isinstance(config, want)):
        return None
    return cls


def read_manifest(path) -> dict:
    """The manifest of a checkpoint folder; :class:`CheckpointError` if it is
    missing (the writer never committed), partial or not ours."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no such directory: {path}")
    mp = path / MANIFEST
    if not mp.exists():
        tmps = sorted(p.name for p in path.glob("*.tmp")) if path.is_dir() else []
        why = (f"; found unfinished {', '.join(tmps)}: the writer was killed before it committed" if tmps
               else "; the writer did not finish, or this is not an autoshard checkpoint")
        raise CheckpointError(f"{mp}: manifest missing, refusing an incomplete checkpoint{why}")
    try:
        man = json.loads(mp.read_text())
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{mp}: unreadable or partial manifest ({type(e).__name__}: {e})") from e
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise CheckpointError(f"{mp}: not an autoshard checkpoint manifest")
    if man.get("version") != VERSION:
        raise CheckpointError(f"{mp}: manifest version {man.get('version')}, this autoshard reads {VERSION}")
    missing = [k for k in ("mesh", "files", "tensors", "complete") if k not in man]
    if missing or man.get("complete") is not True:
        raise CheckpointError(f"{mp}: partial manifest (missing {missing or ['complete']})")
    return man


def _blocks_by_file(man: dict) -> dict[str, list[tuple[str, dict]]]:
    out: dict[str, list] = {}
    for key, ent in man["tensors"].items():
        for b in ent["blocks"]:
            out.setdefault(b["file"], []).append((key, b))
    for v in out.values():
        v.sort(key=lambda kb: kb[1]["offsets"][0])
    return out


def _sha256_file(p: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _sha256_range(p: Path, start: int, end: int, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            b = f.read(min(chunk, left))
            if not b:
                break
            h.update(b)
            left -= len(b)
    return h.hexdigest()


def verify_checkpoint(path, man: dict | None = None) -> dict:
    """Check every file of a checkpoint against its manifest (presence, size,
    sha256); the error names the file and the tensor whose bytes are wrong."""
    path = Path(path)
    man = man if man is not None else read_manifest(path)
    blocks = _blocks_by_file(man)
    for fname, info in man["files"].items():
        p = path / fname
        held = blocks.get(fname, [])
        first = repr(held[0][0]) if held else "(none)"
        if not p.exists():
            raise CheckpointError(f"{p}: file missing (holds tensor {first})")
        size = p.stat().st_size
        if size != info["size"]:
            cut = [k for k, b in held if b["offsets"][1] > size]
            what = f"tensor {cut[0]!r}" + (f" and {len(cut) - 1} more" if len(cut) > 1 else "") if cut \
                else f"its header (before tensor {first})"
            raise CheckpointError(f"{p}: truncated or resized: {size} bytes, manifest says {info['size']}; "
                                  f"{what} cut off")
        if _sha256_file(p) != info["sha256"]:
            for k, b in held:
                if _sha256_range(p, *b["offsets"]) != b["sha256"]:
                    raise CheckpointError(f"{p}: sha256 mismatch in tensor {k!r} (bytes {b['offsets'][0]}.."
                                          f"{b['offsets'][1]}): the file is corrupt")
            raise CheckpointError(f"{p}: sha256 mismatch in the safetensors header (before tensor {first}): "
                                  f"the file is corrupt")
    return man


def dense_shape(ent: dict) -> tuple:
    """A manifest entry's Hugging Face shape (its ``global_shape`` less vocabulary padding)."""
    return tuple(ent.get("dense_shape") or ent["global_shape"])


def check_matches(man: dict, model: nn.Module, path: Path) -> None:
    """Names and global shapes of the manifest against the model to load into."""
    mp = path / MANIFEST
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    covered = set()
    for key, ent in man["tensors"].items():
        if ent["kind"] != "param":
            continue
        where = ent["blocks"][0]["file"] if ent["blocks"] else MANIFEST
        for n in [ent["param"], *ent["aliases"]]:
            if n not in shapes:
                raise CheckpointError(f"{mp}: tensor {n!r} (in {where}) is not a parameter of "
                                      f"{type(model).__name__}: the checkpoint is from another model")
            if shapes[n] != dense_shape(ent):
                raise CheckpointError(f"{mp}: tensor {n!r} (in {where}) has shape {list(dense_shape(ent))}, "
                                      f"{type(model).__name__} has {list(shapes[n])}: the checkpoint is "
                                      f"from another model")
            covered.add(n)
    missing = [n for n in shapes if n not in covered]
    if missing:
        raise CheckpointError(f"{mp}: no tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if
                                                                     len(missing) > 1 else "")
                              + f" of {type(model).__name__}: the checkpoint is from another model")


class Saved:
    """Reads tensors of a checkpoint: whole (assembled from its blocks) or one rank's part."""

    def __init__(self, path: Path, man: dict):
        self.path, self.man = path, man
        self.mesh = Mesh.from_dict(man["mesh"])
        self.files = LazyFiles()
        self.by_name = {}
        for key, ent in man["tensors"].items():
            if ent["kind"] == "param":
                for n in [ent["param"], *ent["aliases"]]:
                    self.by_name[n] = key
        self.bytes_read = 0

    def _block(self, b: dict, key: str) -> torch.Tensor:
        p = self.path / b["file"]
        try:
            t = self.files.handle(p, b["offsets"][1] - b["offsets"][0]).get_tensor(key)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{p}: cannot read tensor {key!r}: {e}") from e
        n = t.numel() * t.element_size()
        self.bytes_read += n
        self.files.touched(p, n)
        return t

    def local(self, key: str, spec: ShardSpec, mesh: Mesh, rank: int, dtype, shape=None,
              segments: int = 1, copies: int = 0, extra: tuple[int, ...] = ()) -> torch.Tensor:
        """``rank``'s block under ``spec`` of the tensor ``key``, whose global shape on
        ``mesh`` is ``shape`` (default: its Hugging Face shape; a padded vocabulary is
        larger; ``segments`` > 1: fused blocks padded each at its end, ``copies``: blocks
        repeated instead, passes/pad.py; ``extra``: dims padded besides, plain zeros at their end)."""
        ent = self.man["tensors"][key]
        saved_spec = ShardSpec.from_dict(ent["spec"])
        saved_shape, dense = tuple(ent["global_shape"]), dense_shape(ent)
        shape = dense if shape is None else tuple(shape)
        if self.mesh == mesh and saved_spec == spec and shape == saved_shape:   # same layout: my own block only
            own = spec.owner(mesh, rank)
            b = next(b for b in ent["blocks"] if b["rank"] == own)
            return self._block(b, key).to(dtype)
        full = None
        for b in ent["blocks"]:
            blk = self._block(b, key)
            if full is None:
                full = torch.empty(saved_shape, dtype=blk.dtype, device=blk.device)
            saved_spec.place(full, blk, self.mesh, b["rank"])
            del blk
        if dense != saved_shape:
            full = _padded_plan(saved_shape, dense, ent.get("pad_segments", 1), ent.get("pad_copies", 0),
                                tuple(ent.get("pad_extra", ()))).trim(full)
        if (segments > 1 or copies) and shape != dense:
            return spec.local(_padded_plan(shape, dense, segments, copies, extra).pad(full), mesh, rank).to(dtype)
        return read_local(full, spec, mesh, rank, dtype=dtype, padded=shape)


def _padded_plan(shape, dense, segments: int, copies: int = 0, extra: tuple[int, ...] = ()):
    """A :class:`~autoshard.ir.plan.ParamPlan` of ``shape`` padded from ``dense`` (its
    ``pad`` / ``trim``: each of ``segments`` fused blocks padded at its own end)."""
    return ParamPlan(name="", global_shape=tuple(shape), spec=replicated(len(shape)), grad_sync=(),
                     dense_shape=tuple(dense), pad_segments=segments, pad_copies=copies, pad_extra=extra)


def fill_from_checkpoint(gm, plan, rank, saved: Saved, built: Built | None, progress, stats) -> None:
    """Every parameter of ``plan`` as this rank's part, read from the checkpoint ``saved``."""
    t0 = time.perf_counter()
    params = list(plan.params)
    for pp in _progress_bar(params, f"loading {saved.path.name}", show_progress(progress, rank, len(params))):
        cur = gm.get_parameter(pp.name)
        key = next((saved.by_name[n] for n in (pp.name, *pp.aliases) if n in saved.by_name), None)
        if key is None:
            raise CheckpointError(f"{saved.path / MANIFEST}: no tensor for parameter {pp.name!r}")
        local = saved.local(key, pp.spec, plan.mesh, rank, cur.dtype, shape=pp.global_shape, segments=pp.pad_segments,
                            copies=pp.pad_copies, extra=pp.pad_extra)
        set_param(gm, (pp.name, *pp.aliases), nn.Parameter(local, requires_grad=cur.requires_grad))
    fill_buffers(gm, built)
    saved.files.close()
    stats.update(tensors=len(params), bytes_read=saved.bytes_read, seconds=time.perf_counter() - t0)


def load_optimizer(optimizer, sharded, saved: Saved) -> None:
    """Restore ``optimizer`` (built over ``sharded``'s parameters) from the checkpoint, resliced."""
    man, mp = saved.man, saved.path / MANIFEST
    oj = man.get("optimizer")
    if not oj:
        raise CheckpointError(f"{mp}: the checkpoint holds no optimizer state")
    params = dict(sharded.named_parameters(remove_duplicate=False))
    plan = {pp.name: pp for pp in sharded.plan.params}
    name_of = {id(params[n]): n for n in plan}
    if len(oj["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"{mp}: {len(oj['param_groups'])} optimizer param group(s) saved, the optimizer "
                              f"has {len(optimizer.param_groups)}")
    state_keys: dict[str, list[str]] = {}
    for key, ent in man["tensors"].items():
        if ent["kind"] == "optim":
            state_keys.setdefault(ent["param"], []).append(key)
    state, groups, idx = {}, [], 0
    for gi, (group, sg) in enumerate(zip(optimizer.param_groups, oj["param_groups"])):
        names = [name_of.get(id(p)) for p in group["params"]]
        if names != sg["params"]:
            raise CheckpointError(f"{mp}: optimizer param group {gi} holds {sg['params'][:3]}..., the new "
                                  f"optimizer {names[:3]}...")
        ids = []
        for p, name in zip(group["params"], names):
            st = {}
            for key in state_keys.get(name, []):
                ent = man["tensors"][key]
                if dense_shape(ent) == plan[name].hf_shape and len(ent["global_shape"]):
                    spec, shape = plan[name].spec, plan[name].global_shape
                else:
                    spec, shape = replicated(len(ent["global_shape"])), None
                st[ent["state_key"]] = saved.local(key, spec, sharded.mesh, sharded.rank,
                                                   getattr(torch, ent["dtype"]), shape=shape)
            st.update({k: decode_value(v) for k, v in oj["extra_state"].get(name, {}).items()})
            if st:
                state[idx] = st
            ids.append(idx)
            idx += 1
        groups.append({**{k: decode_value(v) for k, v in sg.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    saved.files.close()
