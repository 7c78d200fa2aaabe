"""Fill a rewritten module's parameters and buffers: from a Hugging Face folder
(each rank reads only its own slices) or from values it is handed.

A graph captured on meta holds meta parameters and buffers; :func:`fill_from_folder`
replaces each parameter with its local slice read lazily from the folder and
:func:`fill_buffers` gives every buffer its value (the folder's persistent ones,
the constructor's computed ones), then points the graph's factory calls at the CPU.
:func:`check_folder` checks a folder against the model before any process group.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch
from torch import nn

from .builder import Built, build_meta, load_config
from ..ir.errors import AutoshardWarning, CheckpointError, ConfigError
from ..ir.log import progress as _progress_bar
from ..ir.log import show_progress, warn
from ..ir.mesh import Mesh
from ..runtime.device import retarget
from .safetensors_io import FLOAT_CODES, HFFolder
from ..ir.spec import replicated

__all__ = ["FolderLoad", "open_folder", "fill_from_folder", "fill_buffers", "check_folder", "set_param",
           "meta_tensors"]


def set_param(gm: nn.Module, names, value) -> None:
    """Set parameter ``value`` under every name in ``names`` (a tensor and its tied aliases)."""
    for name in names:
        mod_path, _, attr = name.rpartition(".")
        setattr(gm.get_submodule(mod_path) if mod_path else gm, attr, value)


def _set_buffer(gm: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_path, _, attr = name.rpartition(".")
    mod = gm.get_submodule(mod_path) if mod_path else gm
    mod._buffers[attr] = value


def fill_buffers(gm: nn.Module, built: Built | None, folder: HFFolder | None = None,
                 device: torch.device | str = "cpu") -> None:
    """Give every meta buffer its value (from ``folder`` if persistent and stored, else the
    constructor's) on ``device``, retarget the graph to ``device`` and check nothing is
    left on meta."""
    device = torch.device(device)
    for name, buf in list(gm.named_buffers(remove_duplicate=False)):
        if buf.device.type != "meta":
            continue
        value = None
        if folder is not None and built is not None and name in built.persistent:
            key = folder.key_for((name,))
            if key is not None and folder.shape(key) == tuple(buf.shape):
                value = folder.read(key, replicated(buf.dim()), Mesh(axes=("tp",), sizes=(1,)), 0,
                                    dtype=buf.dtype)
        if value is None and built is not None:
            value = built.buffers.get(name)
        if value is None:
            raise CheckpointError(f"buffer {name!r} has no value: it is neither computed by the model's "
                                  f"constructor nor stored in the weights")
        _set_buffer(gm, name, value.to(device, buf.dtype).clone())
    retarget(gm, device)
    _check_materialised(gm)


def meta_tensors(gm: nn.Module) -> list[str]:
    """Names of ``gm``'s tensors still on the meta device: parameters, buffers, and
    tensors a graph reads by attribute (constants export lifted out of a forward)."""
    left = [n for n, t in itertools.chain(gm.named_parameters(remove_duplicate=False),
                                          gm.named_buffers(remove_duplicate=False)) if t.device.type == "meta"]
    for node in getattr(gm, "graph", None).nodes if hasattr(gm, "graph") else ():
        if node.op == "get_attr":
            obj = gm
            for part in node.target.split("."):
                obj = getattr(obj, part, None)
            if isinstance(obj, torch.Tensor) and obj.device.type == "meta" and node.target not in left:
                left.append(node.target)
    return left


def _check_materialised(gm: nn.Module) -> None:
    left = meta_tensors(gm)
    if left:
        raise CheckpointError(f"tensor(s) still on the meta device after loading: {left}")


def fill_from_folder(gm, plan, rank: int, folder: HFFolder, built: Built, progress, stats: dict) -> None:
    """Every parameter of ``plan`` as this rank's slice read from ``folder``; ``stats`` gets
    the tensor count, bytes read and seconds."""
    t0 = time.perf_counter()
    mesh = plan.mesh
    params = list(plan.params)
    for pp in _progress_bar(params, f"reading {folder.path.name}", show_progress(progress, rank, len(params))):
        cur = gm.get_parameter(pp.name)
        names = (pp.name,) + tuple(pp.aliases)
        key = folder.key_for(names)
        if key is None:
            raise CheckpointError(f"{folder.path}: no tensor for parameter {pp.name!r}"
                                  + (f" (nor its tied aliases {list(pp.aliases)})" if pp.aliases else ""))
        shape = folder.shape(key)
        if shape != pp.hf_shape:
            raise CheckpointError(f"{folder.where[key]}: tensor {key!r} has shape {list(shape)}, the model's "
                                  f"{pp.name!r} has {list(pp.hf_shape)}")
        if pp.pad_segments > 1 or pp.pad_copies:    # blocks padded each at its end or copied: read whole, pad, slice
            whole = folder.read(key, replicated(len(shape)), mesh, rank, dtype=cur.dtype)
            local = pp.spec.local(pp.pad(whole), mesh, rank)
        else:
            local = folder.read(key, pp.spec, mesh, rank, dtype=cur.dtype, padded=pp.global_shape)
        set_param(gm, names, nn.Parameter(local, requires_grad=cur.requires_grad))
    fill_buffers(gm, built, folder)
    folder.files.close()
    stats.update(tensors=len(params), bytes_read=folder.bytes_read, seconds=time.perf_counter() - t0)


def check_folder(folder: HFFolder, model: nn.Module, config_name: str = "config.json") -> None:
    """Every parameter of ``model`` (built from the folder's config, on meta) against the
    folder's files, before any process group or read: missing shard files, missing
    tensors, shapes that disagree with the config, non-floating tensors for floating
    parameters. One :class:`CheckpointError` lists every problem, naming file and tensor."""
    problems: list[str] = []
    missing_files: dict[Path, list[str]] = {}
    for key, f in folder.where.items():
        if not f.exists():
            missing_files.setdefault(f, []).append(key)
    for f, keys in missing_files.items():
        problems.append(f"{f}: shard file missing (model.safetensors.index.json maps {len(keys)} tensor(s) to it, "
                        f"e.g. {keys[0]!r})")
    groups: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
        params[id(p)] = p
    used: set[str] = set()
    bad_shapes = 0
    for pid, names in groups.items():
        p = params[pid]
        key = folder.key_for(names)
        if key is None:
            problems.append(f"{folder.path}: no tensor for parameter {names[0]!r}"
                            + (f" (nor its tied aliases {names[1:]})" if len(names) > 1 else ""))
            continue
        used.add(key)
        f = folder.where[key]
        if f in missing_files:
            continue
        _, sl = folder.slice(key)
        shape, code = tuple(sl.get_shape()), sl.get_dtype()
        if shape != tuple(p.shape):
            bad_shapes += 1
            problems.append(f"{f.name}: tensor {key!r} has shape {list(shape)}, {config_name} makes "
                            f"{names[0]!r} {list(p.shape)}")
        if p.is_floating_point() and code not in FLOAT_CODES:
            problems.append(f"{f.name}: tensor {key!r} is stored as {code}, parameter {names[0]!r} is "
                            f"{str(p.dtype).removeprefix('torch.')}: not a floating dtype, refusing to convert")
    folder.files.close()
    if problems:
        hint = (f"; {config_name} does not describe these weights" if bad_shapes else "")
        head = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
        raise CheckpointError(f"{folder.path}: cannot load {len(problems)} tensor(s){hint}:\n"
                              + "\n".join(f"  - {x}" for x in head))
    for name, _ in model.named_buffers(remove_duplicate=False):
        used.add(folder.key_for((name,)) or name)
    extra = sorted(k for k in folder.where if k not in used)
    if extra:
        warn(f"{folder.path}: {len(extra)} tensor(s) in the files are not parameters of the model built "
                      f"from {config_name} and are ignored, e.g. {extra[:3]}", AutoshardWarning, stacklevel=3)


class FolderLoad:
    """A Hugging Face folder ready to shard: the model built on meta from its config
    (``model``, ``config``) and ``fill``, the ``weights`` callback of
    :func:`autoshard.shard` that reads each rank's slices; ``stats`` is filled by it."""

    def __init__(self, built: Built, folder: HFFolder, progress):
        self.built, self.folder, self.progress = built, folder, progress
        self.model, self.config, self.stats = built.model, built.config, {}

    def fill(self, gm, plan, rank) -> None:
        fill_from_folder(gm, plan, rank, self.folder, self.built, self.progress, self.stats)


def open_folder(path, *, model_class=None, dtype=None, train: bool = False, progress=None) -> FolderLoad:
    """Check a local Hugging Face folder against the model its config builds (before
    any process group or read) and return it ready to shard; :class:`ConfigError` for
    a path that is not a folder."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"no such directory: {path}")
    if not path.is_dir():
        raise ConfigError(f"{path} is not a folder (a local Hugging Face folder with config.json is expected)")
    config = load_config(path)
    built = build_meta(config, model_class=model_class, dtype=dtype)
    folder = HFFolder(path, prefix=getattr(built.model, "base_model_prefix", "") or "")
    check_folder(folder, built.model)
    built.model.train(train)
    return FolderLoad(built, folder, progress)
