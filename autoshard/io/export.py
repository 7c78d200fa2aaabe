"""A sharded checkpoint to a dense Hugging Face folder, in one process.

:func:`export_checkpoint` reads a checkpoint written by
:meth:`~autoshard.module.ShardedModule.save_checkpoint` (any mode, any world
size), assembles every tensor from its blocks and writes ``config.json`` (with
``architectures`` naming the class that was sharded) and safetensors that
``AutoModelFor….from_pretrained`` loads. No process group: one process, the
dense model's size in memory one tensor at a time. ``autoshard export CKPT OUT``
is the command line.

    >>> export_checkpoint("does/not/exist", "out")
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.CheckpointError: no such directory: does/not/exist
"""

from __future__ import annotations

from pathlib import Path

import torch

from .builder import build_meta, load_config, resolve_class, with_architecture
from ..ir.errors import CheckpointError
from .gather import write_folder
from ..ir.mesh import Mesh
from .sharded_format import Saved, checkpoint_class, dense_shape, read_manifest, verify_checkpoint
from ..ir.spec import replicated

__all__ = ["export_checkpoint"]


def export_checkpoint(path, out, *, model_class=None, max_shard_size="5GB", verify: bool = True,
                      progress: bool = False) -> Path:
    """Write the dense Hugging Face folder of the sharded checkpoint ``path`` to ``out``.

    The checkpoint's own ``config.json`` (written by ``save_checkpoint``) describes the
    model; its class is the manifest's (``model_class`` overrides it). Tied tensors
    are written under every name, persistent buffers with the values the model's
    constructor gives them. Returns ``out``."""
    path, out = Path(path), Path(out)
    man = read_manifest(path)       # "no such directory", missing or partial manifests: refused there
    if verify:
        verify_checkpoint(path, man)
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path}: no config.json, so the model cannot be rebuilt; save the checkpoint from a "
                              f"module that has a config (shard() of a transformers model, from_pretrained, "
                              f"load_checkpoint) or pass config= to save_checkpoint")
    config = load_config(path)
    cls = resolve_class(config, checkpoint_class(man, model_class, config))
    built = build_meta(config, model_class=cls)
    saved = Saved(path, man)
    one = Mesh(axes=("tp",), sizes=(1,))
    params = [(key, ent) for key, ent in man["tensors"].items() if ent["kind"] == "param"]
    entries = [(n, dense_shape(ent), getattr(torch, ent["dtype"]))
               for _, ent in params for n in (ent["param"], *ent["aliases"])]
    held = {n for n, _, _ in entries}
    buffers = [(n, b) for n, b in built.buffers.items() if n in built.persistent and n not in held]
    entries += [(n, tuple(b.shape), b.dtype) for n, b in buffers]

    def tensors():
        for key, ent in params:
            full = saved.local(key, replicated(len(ent["global_shape"])), one, 0, dtype=getattr(torch, ent["dtype"]))
            for n in (ent["param"], *ent["aliases"]):
                yield n, full
        yield from buffers

    name = cls.__name__ if cls is not None else man.get("model", "")
    write_folder(out, entries, tensors(), with_architecture(config, name), max_shard_size=max_shard_size,
                 progress=progress)
    saved.files.close()
    return out
