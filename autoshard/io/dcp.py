"""``torch.distributed.checkpoint`` (DCP) for sharded modules and their optimizers.

DCP reshards by itself: a checkpoint stores each tensor's global shape and the
rectangular chunks the ranks wrote, and a load reads whatever chunks overlap the
blocks the loading ranks hold, in any mode and on any world size. Its default
planners describe a rank's block of a DTensor as one rectangle; a fused q/k/v
split per segment, or a 2d/3d block split out of mesh order, is several
(``_StridedShard``, :mod:`autoshard.io.dtensor`), so :class:`SavePlanner` and
:class:`LoadPlanner` write and read DTensors piece by piece
(:func:`~autoshard.io.dtensor.local_pieces`) and leave everything else to DCP's
defaults. Pass them to ``dcp.save`` / ``dcp.load``; :func:`save` and :func:`load`
do so for a module and its optimizer::

    import torch.distributed.checkpoint as dcp
    from autoshard.io import dcp as adcp

    adcp.save(sharded, "ckpt", optimizer=opt)            # every rank; any mode
    adcp.load(other, "ckpt", optimizer=other_opt)        # another mode / world size
    # or, by hand:
    dcp.save({"model": sharded.state_dict()}, checkpoint_id="ckpt", planner=adcp.SavePlanner())

The optimizer state is keyed by parameter name, as torch's ``get_optimizer_state_dict``
keys it, with each per-parameter tensor laid out as its parameter (a DTensor), so it
reshards with the model. A dense Hugging Face folder loads through DCP's own
``HuggingFaceStorageReader``::

    from torch.distributed.checkpoint import HuggingFaceStorageReader
    dcp.load(sharded.state_dict(), storage_reader=HuggingFaceStorageReader(folder), planner=adcp.LoadPlanner())

and :func:`save_hf` writes one through DCP's ``HuggingFaceStorageWriter`` (consolidated), where
every block is one rectangle (else through :func:`~autoshard.io.gather.save_pretrained`).

Our own per-rank format converts both ways in one process (``autoshard convert``):
:func:`checkpoint_to_dcp` (ours -> DCP) and :func:`dcp_to_folder` (DCP -> a dense Hugging
Face folder, which loads in any mode and is saved in our format by ``save_checkpoint``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint import planner
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from ..ir.errors import CheckpointError
from .dtensor import from_dtensor, like_fsdp, local_pieces, narrow_piece, to_dtensor, tp_local

__all__ = ["SavePlanner", "LoadPlanner", "save", "load", "optimizer_state_dict", "load_optimizer_state_dict",
           "checkpoint_to_dcp", "dcp_to_folder", "save_hf"]


def _pieces(value) -> list[tuple[tuple, tuple, tuple]]:
    """The non-empty pieces of a DTensor's global tensor this rank holds."""
    dm = value.device_mesh
    return [p for p in local_pieces(tuple(value.shape), value.placements, tuple(dm.mesh.shape), dm.get_coordinate())
            if all(p[2])]


class SavePlanner(default_planner.DefaultSavePlanner):
    """DCP's default save planner; each DTensor is written as the rectangular pieces
    this rank holds (one unless a strided shard makes several). Replicas of a piece
    are written once (DCP's own de-duplication)."""

    def create_local_plan(self):
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, DTensor)}
        plan = default_planner.create_default_local_save_plan(plain, self.is_coordinator)
        items = list(plan.items)
        self._where: dict = {}
        for fqn, v in self.state_dict.items():
            if not isinstance(v, DTensor):
                continue
            props = md.TensorProperties.create_from_tensor(v.to_local())
            for goff, loff, size in _pieces(v):
                self._where[(fqn, goff)] = (loff, size)
                items.append(planner.WriteItem(
                    index=md.MetadataIndex(fqn, torch.Size(goff)), type=planner.WriteItemType.SHARD,
                    tensor_data=planner.TensorWriteData(
                        chunk=md.ChunkStorageMetadata(offsets=torch.Size(goff), sizes=torch.Size(size)),
                        properties=props, size=v.size())))
        plan = dataclasses.replace(plan, items=items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def lookup_object(self, index):
        at = self._where.get((index.fqn, tuple(index.offset or ())))
        if at is None:
            return super().lookup_object(index)
        local = self.state_dict[index.fqn].to_local()
        piece = narrow_piece(local, *at)
        # a piece short of the whole local tensor is copied: a view would be written with all its storage
        return piece if piece.numel() == local.numel() else piece.contiguous().clone()


class LoadPlanner(default_planner.DefaultLoadPlanner):
    """DCP's default load planner; each DTensor is read into the rectangular pieces
    this rank holds, from whatever chunks of the checkpoint overlap them (any mode,
    any world size saved it), in place."""

    def create_local_plan(self):
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, DTensor)}
        plan = default_planner.create_default_local_load_plan(plain, self.metadata, not self.allow_partial_load)
        items = list(plan.items)
        self._where: dict = {}
        for fqn, v in self.state_dict.items():
            if not isinstance(v, DTensor):
                continue
            saved = self.metadata.state_dict_metadata.get(fqn)
            if saved is None:
                if self.allow_partial_load:
                    continue
                raise CheckpointError(f"{fqn}: not in the checkpoint (it holds "
                                      f"{len(self.metadata.state_dict_metadata)} entries)")
            if tuple(saved.size) != tuple(v.shape):
                raise CheckpointError(f"{fqn}: the checkpoint's tensor is {list(saved.size)}, this module's "
                                      f"{list(v.shape)} (another model or config?)")
            chunks = []
            for goff, loff, size in _pieces(v):
                self._where[(fqn, goff)] = (loff, size)
                chunks.append(md.ChunkStorageMetadata(offsets=torch.Size(goff), sizes=torch.Size(size)))
            items += create_read_items_for_chunk_list(fqn, saved, chunks)
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index):
        at = self._where.get((index.fqn, tuple(index.offset or ())))
        if at is None:
            return super().lookup_tensor(index)
        return narrow_piece(self.state_dict[index.fqn].to_local(), *at)


# ------------------------------------------------------------------------------ optimizer state

def _param_names(sharded) -> dict[int, object]:
    """id(local parameter) -> its ParamPlan (tied aliases once, under the plan's name)."""
    from .gather import unique_params

    return {id(p): pp for pp, p in unique_params(sharded)}


def optimizer_state_dict(sharded, optimizer) -> dict:
    """``optimizer``'s state keyed by parameter name, as torch's ``get_optimizer_state_dict``
    gives it: ``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``,
    with every tensor shaped as its parameter a DTensor laid out as that parameter (sharing
    the optimizer's storage). No collective."""
    names = _param_names(sharded)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(id(p) not in names for p in params):
        raise CheckpointError("the optimizer holds tensors that are not this module's parameters")
    raw = optimizer.state_dict()
    state = {}
    for i, p in enumerate(params):
        pp = names[id(p)]
        if i not in raw["state"]:
            continue
        # FSDP2's moments are DTensors of dp chunks: their TP-local blocks (gathered over dp)
        state[pp.name] = {k: (to_dtensor(sharded, pp, tp_local(v)) if isinstance(v, torch.Tensor)
                              and v.shape == p.shape and v.dim() else v) for k, v in raw["state"][i].items()}
    groups, at = [], 0
    for g in raw["param_groups"]:
        n = len(g["params"])
        groups.append({**g, "params": [names[id(p)].name for p in params[at:at + n]]})
        at += n
    return {"state": state, "param_groups": groups}


def load_optimizer_state_dict(sharded, optimizer, osd: dict) -> None:
    """Load what :func:`optimizer_state_dict` gives (from this mode or another: DTensors
    laid out otherwise are gathered and sliced) into ``optimizer``."""
    names = _param_names(sharded)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index = {names[id(p)].name: i for i, p in enumerate(params)}
    plans = {pp.name: pp for pp in names.values()}
    state = {}
    for name, st in osd["state"].items():
        if name not in index:
            raise CheckpointError(f"optimizer state for {name!r}, which the optimizer does not hold")
        p = params[index[name]]
        st = {k: (from_dtensor(sharded, plans[name], v) if isinstance(v, DTensor) else v) for k, v in st.items()}
        if isinstance(p, DTensor):      # FSDP2: each moment as its parameter's dp chunk
            st = {k: (like_fsdp(p, v) if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in st.items()}
        state[index[name]] = st
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _init_state(optimizer) -> None:
    """Give every parameter its optimizer state (zero gradients, one step at lr 0): a load
    needs tensors to read into. torch's own helper where it has one."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)
    for g in optimizer.param_groups:
        for p in g["params"]:
            p.grad = None


# ------------------------------------------------------------------------------ module + optimizer

def _check_model(model_state: dict, path) -> None:
    """Every tensor of ``model_state`` is in the DCP checkpoint at ``path`` with its shape;
    else :class:`CheckpointError` naming the first ones (read from the checkpoint's
    metadata file: no collective)."""
    from pathlib import Path

    if not (Path(path) / ".metadata").exists():
        raise CheckpointError(f"{path}: not a DCP checkpoint (no .metadata); write one with autoshard.io.dcp.save")
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing, wrong = [], []
    for k, v in model_state.items():
        if not isinstance(v, torch.Tensor):
            continue
        md = saved.get(f"model.{k}")
        if md is None:
            missing.append(k)
        elif tuple(getattr(md, "size", ())) != tuple(v.shape):
            wrong.append(f"{k} {list(md.size)} in the checkpoint, {list(v.shape)} here")
    if missing or wrong:
        have = sorted(n[len("model."):] for n in saved if n.startswith("model."))
        raise CheckpointError(f"{path}: the checkpoint does not hold this model: "
                              + (f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}" if missing else "")
                              + ("; " if missing and wrong else "") + "; ".join(wrong[:3])
                              + f" (it holds {len(have)} model tensors, e.g. {have[:2]})")


def save(sharded, path, *, optimizer=None) -> None:
    """Save ``sharded`` (and ``optimizer``'s state) as a DCP checkpoint in ``path``.
    Collective: call on every rank. Loads back in any mode and world size (:func:`load`)."""
    state = {"model": sharded.state_dict()}
    if optimizer is not None:
        state["optim"] = optimizer_state_dict(sharded, optimizer)
    dcp.save(state, checkpoint_id=str(path), planner=SavePlanner())
    _write_config(sharded, path)


def load(sharded, path, *, optimizer=None) -> None:
    """Load a DCP checkpoint written by :func:`save` (any mode, any world size) into
    ``sharded`` and ``optimizer``, in place. Collective: call on every rank."""
    state = {"model": sharded.state_dict()}
    _check_model(state["model"], path)      # before any collective, on every rank alike
    if optimizer is not None:
        _init_state(optimizer)
        state["optim"] = optimizer_state_dict(sharded, optimizer)
    dcp.load(state, checkpoint_id=str(path), planner=LoadPlanner())
    if sharded.fsdp:
        sharded.load_state_dict(state["model"])     # FSDP2: the state dict held gathered copies
    else:
        _copy_back_whole(sharded, state["model"])
    if optimizer is not None:
        load_optimizer_state_dict(sharded, optimizer, state["optim"])


def _copy_back_whole(sharded, model_state: dict) -> None:
    """Tensors of unequal fused blocks (``ShardSpec.widths``) were read into gathered
    copies (:func:`~autoshard.io.dtensor.placements` presents them whole): slice each
    back into its parameter."""
    params = dict(sharded.named_parameters(remove_duplicate=False))
    for pp in sharded.plan.params:
        if pp.spec.widths and pp.name in params and isinstance(model_state.get(pp.name), DTensor):
            with torch.no_grad():
                params[pp.name].copy_(from_dtensor(sharded, pp, model_state[pp.name]))


# ------------------------------------------------------------------------------ converters

def _write_config(sharded, path) -> None:
    """``config.json`` next to the DCP files (rank 0), so the folder converts to a Hugging
    Face one without the model at hand."""
    import torch.distributed as dist

    from .builder import with_architecture

    config = getattr(sharded, "config", None)
    if config is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        with_architecture(config, sharded.plan.model).save_pretrained(str(path))


def checkpoint_to_dcp(src, out, *, verify: bool = True, progress: bool = False):
    """Our sharded checkpoint (:meth:`~autoshard.module.ShardedModule.save_checkpoint`, any
    mode and world size) as a DCP checkpoint :func:`load` reads at any mode and world size:
    the model's tensors under ``model.<HF name>`` (tied aliases and persistent buffers
    included, as ``state_dict()`` lists them), and ``config.json``. One process, no
    process group; the dense model in memory (DCP writes one dict). The optimizer state
    stays behind (our format keeps it per rank; resume from our format for it)."""
    from pathlib import Path

    from ..ir.mesh import Mesh
    from ..ir.spec import replicated
    from .builder import build_meta, load_config, resolve_class
    from .sharded_format import Saved, checkpoint_class, read_manifest, verify_checkpoint

    src, out = Path(src), Path(out)
    man = read_manifest(src)
    if verify:
        verify_checkpoint(src, man)
    saved = Saved(src, man)
    one = Mesh(axes=("tp",), sizes=(1,))
    model: dict = {}
    for key, ent in man["tensors"].items():
        if ent["kind"] != "param":
            continue
        full = saved.local(key, replicated(len(ent["global_shape"])), one, 0, dtype=getattr(torch, ent["dtype"]))
        for n in (ent["param"], *ent["aliases"]):
            model[n] = full
    saved.files.close()
    if (src / "config.json").exists():
        config = load_config(src)
        built = build_meta(config, model_class=resolve_class(config, checkpoint_class(man, None, config)))
        model.update({n: b for n, b in built.buffers.items() if n in built.persistent and n not in model})
        config.save_pretrained(str(out))
    dcp.save({"model": model}, checkpoint_id=str(out), no_dist=True)
    return out


def dcp_to_folder(src, out, *, max_shard_size="5GB", progress: bool = False):
    """A DCP checkpoint written by :func:`save` (or :func:`checkpoint_to_dcp`) as a dense
    Hugging Face folder (safetensors + its ``config.json``): what ``from_pretrained``,
    :func:`autoshard.shard` (a path) and :func:`autoshard.from_pretrained` load, in any
    mode, and :meth:`~autoshard.module.ShardedModule.save_checkpoint` turns into our
    format. One process, no process group; the dense model in memory."""
    from pathlib import Path

    from .builder import load_config
    from .gather import write_folder

    src, out = Path(src), Path(out)
    if not (src / ".metadata").exists():
        raise CheckpointError(f"{src}: not a DCP checkpoint (no .metadata)")
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}        # filled from the checkpoint's own metadata (what dcp_to_torch_save does)
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(src)),
                     planner=default_planner._EmptyStateDictLoadPlanner(), no_dist=True)
    model = state.get("model")
    if not isinstance(model, dict) or not model:
        raise CheckpointError(f"{src}: no 'model' entries (written by autoshard.io.dcp.save?); it holds "
                              f"{sorted(state)}")
    config = load_config(src) if (src / "config.json").exists() else None
    entries = [(n, tuple(t.shape), t.dtype) for n, t in model.items()]
    write_folder(out, entries, iter(model.items()), config, max_shard_size=max_shard_size, progress=progress)
    return out


def _one_piece(value) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return not any(isinstance(p, _StridedShard) for p in value.placements)


def save_hf(sharded, path) -> str:
    """Write a dense Hugging Face folder (safetensors + ``config.json``) through DCP's own
    ``HuggingFaceStorageWriter``: every rank writes its blocks, then they are consolidated
    into ``model-0000N-of-0000M.safetensors``. That writer takes one rectangle per rank
    and tensor; a module with strided shards (fused q/k/v, 2d/3d blocks split out of mesh
    order) is written by :func:`autoshard.io.gather.save_pretrained` instead (gathered one
    tensor at a time to rank 0). Returns which writer wrote it: ``"dcp"`` or ``"gather"``.
    Collective: call on every rank."""
    import torch.distributed as dist

    from .gather import save_pretrained

    state = sharded.state_dict()
    # placements come from the plan and the mesh alone: every rank takes the same way
    if not all(_one_piece(v) for v in state.values() if isinstance(v, DTensor)):
        save_pretrained(sharded, path)
        return "gather"
    dcp.save(state, planner=SavePlanner(),
             storage_writer=dcp.HuggingFaceStorageWriter(str(path), save_distributed=True, enable_consolidation=True))
    _write_config(sharded, path)
    dist.barrier()
    return "dcp"
