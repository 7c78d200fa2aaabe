"""Cached captures and plans of the tiny models, shared by the planning tests.

``torch.export`` dominates the cost of ``autoshard.ir.plan`` on a tiny model (seconds
per call on a loaded CPU box), so a capture is made once per (model class,
config, mode, device) and reused; everything after the capture
(policy / mesh validation, model construction, propagation) runs for real in every
``autoshard.ir.plan`` call. The memo is installed only for the duration of one
:func:`plan_for` call, so other tests see the unpatched library.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import transformers

import autoshard
import autoshard.launch.pipeline as _api      # its capture stage calls capture_for_plan
import models

ANNOTATED_KINDS = ("linear", "norm", "attention", "embedding", "loss")

# (model, mode, world, depth) for every plan the planning tests look at
MATRIX = [(m, mode, w, d) for m in ("gpt2", "llama", "bert")
          for mode, w, d in (("1d", 2, None), ("1d", 4, None), ("2d", 4, None), ("2.5d", 8, 2))]

BATCH, SEQ = 8, 16

_CAPTURES: dict = {}


def case_id(case) -> str:
    m, mode, w, d = case
    return f"{m}-{mode}-w{w}" + (f"-d{d}" if d else "")


def config(name: str):
    """The tiny config of ``name`` with ``architectures`` set so that
    ``autoshard.ir.plan`` builds the right head class."""
    cls, cfg_cls, kw = models.TINY[name]
    cfg = getattr(transformers, cfg_cls)(**kw)
    cfg.architectures = [cls]
    return cfg


def _key(model):
    p = next(model.parameters())
    return (type(model).__name__, model.config.to_json_string(), model.training, p.device.type)


def cached_capture(model, **kw):
    """``autoshard.passes.capture.capture(model)``, once per model class / config / mode / device."""
    from autoshard.passes.capture import capture

    if any(v is not None for v in kw.values()):
        return capture(model, **kw)
    key = _key(model)
    if key not in _CAPTURES:
        _CAPTURES[key] = capture(model)
    return _CAPTURES[key]


@contextlib.contextmanager
def memo_capture():
    orig = _api.capture_for_plan
    _api.capture_for_plan = cached_capture
    try:
        yield
    finally:
        _api.capture_for_plan = orig


def meta_model(name: str):
    """The model ``autoshard.plan(config(name))`` builds: weights on the meta device, train mode."""
    cls = getattr(transformers, models.TINY[name][0])
    with torch.device("meta"):
        m = cls(config(name))
    m.train()
    return m


@functools.lru_cache(maxsize=None)
def plan_for(name: str, mode: str, world: int, depth: int | None = None):
    with memo_capture():
        return autoshard.plan(config(name), world_size=world, mode=mode, depth=depth,
                              batch_size=BATCH, seq_len=SEQ)


def local_numel_by_slicing(pp, mesh, rank: int) -> int:
    """Number of elements of ``pp``'s block on ``rank``, by actually slicing a meta tensor."""
    t = torch.empty(pp.global_shape, device="meta")
    return math.prod(pp.spec.local(t, mesh, rank).shape)
