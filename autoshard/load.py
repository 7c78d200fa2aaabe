"""The loading faces, next to :func:`autoshard.shard`: :func:`from_pretrained`
(a Hugging Face folder, each rank reading only its slices) and
:func:`load_checkpoint` (an autoshard checkpoint onto any mode and world size).

Both build the model on meta (:mod:`autoshard.io.builder`), check the files
against it before any process group, and hand :func:`autoshard.shard` a
``weights`` callback that fills the rewritten module
(:mod:`autoshard.io.hf_fill`, :mod:`autoshard.io.sharded_format`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from torch import nn

from .api import shard
from .io.builder import build_meta, load_config
from .ir.errors import CheckpointError, ConfigError
from .ir.log import quiet_on_other_ranks
from .io.hf_fill import open_folder
from .io.safetensors_io import HFFolder
from .io.sharded_format import Saved, check_matches, checkpoint_class, fill_from_checkpoint, load_optimizer, read_manifest, \
    verify_checkpoint

__all__ = ["from_pretrained", "load_checkpoint"]


@quiet_on_other_ranks
def from_pretrained(path, *, mode: str, depth: int | None = None, dp: int = 1, dtype=None,
                    example_inputs: dict | None = None, model_class=None, train: bool = False,
                    gather_logits: bool = True, progress: bool | None = None):
    """Shard a Hugging Face folder with each rank reading only its own slices.

    The model is built on the meta device from ``config.json`` (class from
    ``config.architectures`` or ``model_class``, a class or its name in
    ``transformers``), captured and planned as :func:`autoshard.shard` does, and
    every parameter is filled from the folder's safetensors (``model.safetensors``
    or a sharded ``model.safetensors.index.json``) with lazy ``get_slice`` reads.
    Tied weights missing from the files (``lm_head.weight``) come from their alias.
    Non-persistent buffers come from the model's own constructor.

    ``dtype``: None = float32 (what ``cls(config)`` builds), ``"auto"`` = the
    config's dtype, or a torch dtype; file tensors are converted on read.
    ``train=False`` captures in eval mode (dropout off), as HF's from_pretrained
    returns; the captured mode is fixed. Call under torchrun or with a process
    group, on every rank::

        sharded = autoshard.from_pretrained("path/to/model", mode="1d")
    """
    src = open_folder(path, model_class=model_class, dtype=dtype, train=train, progress=progress)
    sharded = shard(src.model, mode=mode, depth=depth, dp=dp, example_inputs=example_inputs,
                    gather_logits=gather_logits, weights=src.fill)
    sharded.config = src.config
    sharded.load_stats = src.stats
    return sharded


@quiet_on_other_ranks
def load_checkpoint(path, model_or_path=None, *, mode: str, depth: int | None = None, dp: int = 1,
                    optimizer: Callable | None = None, example_inputs: dict | None = None, dtype=None,
                    model_class=None, train: bool | None = None, gather_logits: bool = True,
                    verify: bool = True, progress: bool | None = None):
    """Load a checkpoint written by :func:`save_checkpoint` onto any mode and world size.

    ``model_or_path``: the model to shard (its weights are replaced), a config, a
    HF folder or ``None`` (the checkpoint's own ``config.json``); a model built
    here lives on meta until the checkpoint fills it. ``optimizer``: a factory
    called with the new module's parameters (``torch.optim.AdamW`` or
    ``lambda ps: AdamW(ps, lr=1e-4)``); its state is restored and
    ``(sharded, optimizer)`` returned, else the module alone. ``train`` (default
    True for a model built here) is the mode the graph is captured in.

    Refused with :class:`CheckpointError` (file and tensor named, raised the same
    on every rank before any collective): no or partial manifest, a missing,
    truncated or corrupt file, a manifest of another model."""
    path = Path(path)
    man = read_manifest(path)
    if verify:
        verify_checkpoint(path, man)
    built = None
    if isinstance(model_or_path, nn.Module):
        model, config = model_or_path, getattr(model_or_path, "config", None)
        if train is not None:
            model.train(train)
    else:
        if model_or_path is None:
            if not (path / "config.json").exists():
                raise CheckpointError(f"{path}: no config.json; pass the model, its config or its folder")
            config = load_config(path)
        elif isinstance(model_or_path, (str, os.PathLike)):
            config = load_config(model_or_path)
        else:
            config = model_or_path
        built = build_meta(config, model_class=checkpoint_class(man, model_class, config), dtype=dtype)
        model = built.model
        model.train(True if train is None else train)
    check_matches(man, model, path)
    saved = Saved(path, man)
    stats: dict = {}

    def fill(gm, plan, rank):
        fill_from_checkpoint(gm, plan, rank, saved, built, progress, stats)

    sharded = shard(model, mode=mode, depth=depth, dp=dp, example_inputs=example_inputs,
                    gather_logits=gather_logits, weights=fill)
    sharded.config = config
    sharded.load_stats = stats
    if optimizer is None:
        return sharded
    opt = optimizer(sharded.parameters())
    load_optimizer(opt, sharded, saved)
    return sharded, opt
