"""Compatibility names for checkpoint I/O, which now lives in one module per job:

* :mod:`autoshard.load`: :func:`from_pretrained`, :func:`load_checkpoint` (the faces);
* :mod:`autoshard.io.gather`: :func:`full_state_dict`, :func:`iter_full_state_dict`,
  :func:`save_pretrained` (dense tensors, gathered one at a time);
* :mod:`autoshard.io.sharded_format`: :func:`save_checkpoint`, :func:`read_manifest`,
  :func:`verify_checkpoint` (one safetensors file per rank + manifest);
* :mod:`autoshard.io.safetensors_io`: :func:`read_local` (lazy slice reads), the stream writer,
  :func:`write_atomic`;
* :mod:`autoshard.io.hf_fill`: filling a rewritten module from a Hugging Face folder;
* :mod:`autoshard.io.builder`: the model on meta;
* the block geometry: :meth:`autoshard.ir.spec.ShardSpec.pieces` / ``local`` / ``place``.

    >>> from autoshard.checkpoint import MANIFEST
    >>> MANIFEST
    'manifest.json'
"""

from __future__ import annotations

from torch import Tensor

from .io.gather import full_state_dict, iter_full_state_dict, save_pretrained
from .load import from_pretrained, load_checkpoint
from .ir.mesh import Mesh
from .io.safetensors_io import read_local, write_atomic
from .io.sharded_format import FORMAT, MANIFEST, read_manifest, save_checkpoint, verify_checkpoint
from .ir.spec import ShardSpec

__all__ = ["from_pretrained", "load_checkpoint", "save_checkpoint", "save_pretrained", "full_state_dict",
           "iter_full_state_dict", "read_local", "place_local", "read_manifest", "verify_checkpoint",
           "write_atomic", "MANIFEST", "FORMAT"]


def place_local(out: Tensor, block: Tensor, spec: ShardSpec, mesh: Mesh, rank: int) -> None:
    """Write ``rank``'s ``block`` into the global tensor ``out``: :meth:`ShardSpec.place`."""
    spec.place(out, block, mesh, rank)
