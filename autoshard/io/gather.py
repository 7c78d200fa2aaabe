"""Dense tensors from a sharded module: gathered one tensor at a time.

:func:`iter_full_state_dict` / :func:`full_state_dict` give the dense tensors
under the Hugging Face names (tied aliases included): the ranks that hold
distinct blocks gather them (``dist.gather`` to rank 0, or ``all_gather``) and
the blocks are placed into the global tensor (:meth:`ShardSpec.place`).
:func:`save_pretrained` streams that generator into safetensors files whose
header is written first (shapes and dtypes are known from the plan), so rank 0
never holds more than one dense tensor. All three are collective: call them on
every rank.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import torch

from .builder import with_architecture
from .dtensor import tp_local
from ..runtime.collectives import entry_barrier
from ..ir.errors import ConfigError
from ..ir.log import progress as _progress_bar
from ..ir.log import show_progress
from ..ir.mesh import Mesh
from .safetensors_io import StreamWriter, write_atomic
from ..ir.spec import ShardSpec

__all__ = ["iter_full_state_dict", "full_state_dict", "save_pretrained", "write_folder", "parse_size",
           "persistent_buffers", "unique_params"]


def _dist():
    import torch.distributed as dist

    return dist


def _group(sharded, axes: tuple[str, ...]):
    """This rank's process group over ``axes`` (the plan's own when it has one;
    else created collectively, in the same order on every rank)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._resolve_process_group(sharded.group_name(axes))


def _gather_axes(spec: ShardSpec, mesh: Mesh) -> tuple[str, ...]:
    return tuple(a for a in mesh.axes if a in spec.axes)


def _gather(sharded, local: torch.Tensor, spec: ShardSpec, shape, rank0_only: bool) -> torch.Tensor | None:
    dist = _dist()
    mesh, rank = sharded.mesh, sharded.rank
    if not spec.axes:
        return local if (not rank0_only or rank == 0) else None
    gaxes = _gather_axes(spec, mesh)
    if rank0_only and 0 not in mesh.group_ranks(gaxes, rank):
        return None
    pg = _group(sharded, gaxes)
    order = dist.get_process_group_ranks(pg)
    local = local.contiguous()
    receives = rank == 0 or not rank0_only
    out = torch.empty(tuple(shape), dtype=local.dtype, device=local.device) if receives else None
    # only dim 0 split, no segments: each block is a contiguous chunk of the result, receive in place
    direct = not any(spec.dims[1:]) and spec.segments[0] == 1
    if receives:
        if direct:
            chunks = out.chunk(len(order))
            lst = [chunks[mesh.index(spec.dims[0], r)] for r in order]
        else:
            lst = [torch.empty_like(local) for _ in order]
    if rank0_only:
        dist.gather(local, lst if receives else None, group=pg, group_dst=order.index(0))
    else:
        dist.all_gather(lst, local, group=pg)
    if receives and not direct:
        for r, blk in zip(order, lst):
            spec.place(out, blk, mesh, r)
    return out


def unique_params(sharded):
    """(ParamPlan, local parameter) once per tensor (tied aliases counted once)."""
    params = dict(sharded.named_parameters(remove_duplicate=False))
    seen = set()
    for pp in sharded.plan.params:
        if pp.is_buffer or pp.name not in params:
            continue
        p = params[pp.name]
        if id(p) in seen:
            continue
        seen.add(id(p))
        yield pp, p


def persistent_buffers(sharded) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` for the buffers a state dict holds."""
    out = []
    for name, buf in sharded.named_buffers(remove_duplicate=False):
        mod_path, _, attr = name.rpartition(".")
        mod = sharded.get_submodule(mod_path) if mod_path else sharded
        if attr not in mod._non_persistent_buffers_set:
            out.append((name, buf))
    return out


def _dense_entries(sharded, aliases: bool = True) -> list[tuple[str, tuple, torch.dtype]]:
    params = dict(sharded.named_parameters(remove_duplicate=False))
    out = []
    for pp in sharded.plan.params:
        dt = params[pp.name].dtype
        for n in (pp.name,) + (tuple(pp.aliases) if aliases else ()):
            out.append((n, pp.hf_shape, dt))
    out += [(n, tuple(b.shape), b.dtype) for n, b in persistent_buffers(sharded)]
    return out


def iter_full_state_dict(sharded, *, rank0_only: bool = True, aliases: bool = True,
                         copy: bool = False, only=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF name, dense tensor)`` one tensor at a time, in plan order (tied
    aliases right after their tensor, the same object), then persistent buffers.

    Every rank must iterate to the end (the gathers are collective); with
    ``rank0_only`` only rank 0 gets tensors, the others yield nothing. Replicated
    tensors are the live local tensors unless ``copy`` (gathered ones are new).
    ``only`` (a set of names): gather just the parameters named there (under any of
    their names), and no buffer."""
    plan, mesh = sharded.plan, sharded.mesh
    params = dict(sharded.named_parameters(remove_duplicate=False))
    # create the groups first, collectively: later some ranks skip tensors they do not gather
    for axes in sorted({_gather_axes(pp.spec, mesh) for pp in plan.params if pp.spec.axes},
                       key=lambda a: (len(a), [mesh.axes.index(x) for x in a])):
        _group(sharded, axes)
    for pp in plan.params:
        if only is not None and not only & {pp.name, *pp.aliases}:
            continue
        # an FSDP2 module's parameter is a DTensor of dp chunks: its TP-local block first (collective over dp)
        full = _gather(sharded, tp_local(params[pp.name].detach()), pp.spec, pp.global_shape, rank0_only)
        if full is None:
            continue
        full = pp.trim(full)        # a padded vocabulary back to its Hugging Face size
        if copy and not pp.spec.axes:
            full = full.clone()
        yield pp.name, full
        if aliases:
            for a in pp.aliases:
                yield a, full
        del full            # the consumer may have dropped it: do not hold it across the next gather
    if only is None and (not rank0_only or sharded.rank == 0):
        for name, buf in persistent_buffers(sharded):
            yield name, buf.detach().clone() if copy else buf.detach()


def full_state_dict(sharded, *, rank0_only: bool = True, aliases: bool = True) -> dict[str, torch.Tensor]:
    """Dense tensors under HF names (tied aliases included). With ``rank0_only``
    (default) rank 0 gets the dict and the other ranks an empty one. Every tensor
    is a new one (not a view of a live parameter)."""
    entry_barrier("full_state_dict")
    return dict(iter_full_state_dict(sharded, rank0_only=rank0_only, aliases=aliases, copy=True))


def parse_size(s) -> int:
    """Bytes from an int or a size such as ``"5GB"`` / ``"500MiB"``.

    >>> parse_size("5GB"), parse_size("1KiB")
    (5000000000, 1024)
    """
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B)?\s*", str(s), re.I)
    if not m:
        raise ConfigError(f"bad size {s!r}; use bytes or e.g. '5GB', '500MB'")
    mult = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[(m.group(2) or "").upper()]
    return int(float(m.group(1)) * mult)


def save_pretrained(sharded, path, *, config=None, max_shard_size="5GB", aliases: bool = True,
                    progress: bool | None = None) -> None:
    """Write a dense Hugging Face folder (config.json + safetensors) from a sharded module.

    Call on every rank. Tensors are gathered to rank 0 one at a time and streamed
    into files whose headers are written first; several files and a
    ``model.safetensors.index.json`` when the total exceeds ``max_shard_size``.
    Tied tensors are written under every name (``aliases=True``): HF's own
    save_pretrained writes only the source of each tie and relies on the class's
    ``_tied_weights_keys`` and the config to re-tie, which a module traced from a
    graph does not know; the duplicate costs the bytes of the tied tensors and
    loads right either way. ``aliases=False`` writes the plan's name only.
    ``config``: the HF config (default: the one :func:`from_pretrained` /
    :func:`load_checkpoint` stored on the module)."""
    dist = _dist()
    config = config if config is not None else getattr(sharded, "config", None)
    if config is None:
        raise ConfigError("save_pretrained needs the model's config: pass config=model.config "
                          "(modules from autoshard.from_pretrained / load_checkpoint carry it)")
    entry_barrier("save_pretrained")
    rank = sharded.rank
    path = Path(path)
    entries = _dense_entries(sharded, aliases=aliases)
    gen = iter_full_state_dict(sharded, rank0_only=True, aliases=aliases)
    write_folder(path, entries, gen, with_architecture(config, sharded.plan.model) if rank == 0 else None,
                 max_shard_size=max_shard_size, progress=show_progress(progress, rank, len(entries)))
    if dist.is_initialized():
        dist.barrier()


def write_folder(path, entries, tensors, config, *, max_shard_size="5GB", progress: bool = False) -> None:
    """Stream ``tensors`` (``(name, tensor)`` pairs in the order of ``entries``, a list of
    ``(name, shape, dtype)``) into a Hugging Face folder: ``model.safetensors``, or several
    files and ``model.safetensors.index.json`` above ``max_shard_size``, then ``config``
    as ``config.json``. A process whose ``tensors`` yields nothing (a rank other than 0
    of a gather, which must still iterate it) writes nothing. Nothing is half-written:
    each file is committed only once complete."""
    path = Path(path)
    limit = parse_size(max_shard_size)
    files: list[list] = [[]]
    size = 0
    for e in entries:
        n = torch.Size(e[1]).numel() * torch.empty((), dtype=e[2], device="meta").element_size()
        if files[-1] and size + n > limit:
            files.append([])
            size = 0
        files[-1].append(e)
        size += n
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    writers: list[StreamWriter] = []
    where = {e[0]: i for i, fe in enumerate(files) for e in fe}
    try:
        for name, t in _progress_bar(tensors, f"writing {path.name}", progress, total=len(entries)):
            i = where[name]
            if not writers:
                path.mkdir(parents=True, exist_ok=True)
            while len(writers) <= i:
                writers.append(StreamWriter(path / names[len(writers)], files[len(writers)]))
            writers[i].write(name, t.to("cpu"))
            del t
        for w in writers:
            w.commit()
        if writers and len(files) > 1:
            index = {"metadata": {"total_size": sum(w.offsets[n][1] - w.offsets[n][0]
                                                    for w in writers for n in w.order)},
                     "weight_map": {e[0]: names[i] for i, fe in enumerate(files) for e in fe}}
            write_atomic(path / "model.safetensors.index.json", json.dumps(index, indent=2))
        if writers and config is not None:
            config.save_pretrained(str(path))
    except BaseException:
        for w in writers:
            w.abort()
        raise


def save_merged(sharded, path, merge, *, config=None, max_shard_size="5GB") -> None:
    """Write the dense Hugging Face folder of ``merge(dense state dict)`` (e.g. a peft
    model's adapters merged into its base weights, :meth:`autoshard.adapters.Adapters.merged`).
    Call on every rank: the tensors are gathered to rank 0, which merges and writes."""
    dist = _dist()
    config = config if config is not None else getattr(sharded, "config", None)
    if config is None:
        raise ConfigError("save_pretrained needs the model's config: pass config=model.config")
    entry_barrier("save_pretrained")
    dense = dict(iter_full_state_dict(sharded, rank0_only=True, aliases=False, copy=True))
    if sharded.rank == 0:
        state = {n: t for n, t in merge(dense).items() if not t.is_meta}
        entries = [(n, tuple(t.shape), t.dtype) for n, t in state.items()]
        write_folder(path, entries, iter(state.items()), with_architecture(config, sharded.plan.model),
                     max_shard_size=max_shard_size)
    if dist.is_initialized():
        dist.barrier()
