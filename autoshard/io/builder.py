"""Build a Hugging Face model on the meta device from a model, a config or a folder.

One builder for every caller: :func:`model_from` (planning: everything on meta)
and :func:`build_meta` (loading: parameters on meta, buffers real, since
non-persistent buffers such as RoPE's ``inv_freq`` are computed by the
constructor and are not in the weight files). Both pick the class the same way
(:func:`resolve_class`).

    >>> import transformers
    >>> cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, architectures=["GPT2LMHeadModel"])
    >>> type(model_from(cfg)).__name__, next(model_from(cfg).parameters()).device.type
    ('GPT2LMHeadModel', 'meta')
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
from torch import nn

from ..ir.errors import ConfigError

__all__ = ["model_from", "construct", "build_meta", "resolve_class", "with_architecture", "load_config", "resolve_dtype", "Built",
           "skeleton"]


def resolve_class(config, model_class=None):
    """The class to build: ``model_class`` (a class or its name in ``transformers``),
    else the first of ``config.architectures`` that transformers has, else None."""
    import transformers

    if model_class is not None:
        if isinstance(model_class, str):
            cls = getattr(transformers, model_class, None)
            if cls is None:
                raise ConfigError(f"transformers has no class {model_class!r}")
            return cls
        return model_class
    for a in getattr(config, "architectures", None) or []:
        if hasattr(transformers, a):
            return getattr(transformers, a)
    return None


def with_architecture(config, class_name: str):
    """A copy of ``config`` whose ``architectures`` names ``class_name`` (when transformers
    has that class), so a saved folder rebuilds the model it came from: a classifier
    fine-tuned from a ``BertModel`` checkpoint saves as ``BertForSequenceClassification``."""
    import copy

    import transformers

    if config is None or not hasattr(transformers, class_name):
        return config
    config = copy.deepcopy(config)
    config.architectures = [class_name]
    return config


def construct(config, cls):
    """``cls(config)``, or the first Auto class that accepts the config."""
    import transformers

    if cls is not None:
        return cls(config)
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM, transformers.AutoModel):
        try:
            return auto.from_config(config)
        except ValueError:
            continue
    raise ConfigError(f"cannot build a model for config {type(config).__name__}; pass model_class=")


def load_config(path):
    """``AutoConfig.from_pretrained(path)``; :class:`ConfigError` naming the path if it fails."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"cannot read a config from {path}: {e}") from e


def model_from(obj, *, meta: bool = True):
    """A model (on meta when built here) from a model, a config, or a local path."""
    if isinstance(obj, torch.nn.Module):
        return obj
    config = load_config(obj) if isinstance(obj, (str, os.PathLike)) else obj
    with torch.device("meta") if meta else torch.device("cpu"):
        return construct(config, resolve_class(config))


@contextlib.contextmanager
def _params_on_meta():
    """Parameters go to the meta device as they are registered; buffers stay real."""
    orig = nn.Module.register_parameter

    def register_parameter(self, name, param):
        orig(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = orig


@contextlib.contextmanager
def _default_dtype(dtype):
    if dtype is None:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resolve_dtype(dtype, config):
    """None, ``"auto"`` (the config's dtype), a name or a floating torch dtype -> dtype or None."""
    if dtype is None:
        return None
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if dtype is None:
            return None
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch dtype, 'auto' or None, got {dtype!r}")
    return dtype


class Built:
    """A model on meta for capture, plus the real values of its buffers
    (``buffers``: name -> tensor; ``persistent``: the names a state dict holds)."""

    def __init__(self, model, buffers: dict, persistent: set, config):
        self.model, self.buffers, self.persistent, self.config = model, buffers, persistent, config


def skeleton(model: nn.Module) -> Built:
    """A copy of ``model`` (any ``nn.Module``, no config needed) with its parameters and
    buffers on meta, its buffers' real values kept aside: what a new input signature of a
    module that is not a transformers model is captured from (``build_meta`` rebuilds one
    from its config). No parameter's data is copied.

    >>> b = skeleton(torch.nn.BatchNorm1d(4))
    >>> b.model.weight.device.type, b.buffers["running_var"].tolist()
    ('meta', [1.0, 1.0, 1.0, 1.0])"""
    memo: dict = {}
    for _, t in model.named_parameters(remove_duplicate=False):
        memo[id(t)] = nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers(remove_duplicate=False)}
    for _, b in model.named_buffers(remove_duplicate=False):
        memo[id(b)] = torch.empty_like(b, device="meta")
    meta = copy.deepcopy(model, memo)
    pnames = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    persistent = {k for k in model.state_dict(keep_vars=True) if k not in pnames}
    return Built(meta, buffers, persistent, getattr(model, "config", None))


def build_meta(config, *, model_class=None, dtype=None, adapt=None) -> Built:
    """The model of ``config`` with parameters on meta and its buffers' real values kept aside.
    ``adapt(model)``, where given, returns the model to keep instead (e.g. with adapters
    injected, :meth:`autoshard.adapters.Adapters.inject`); its new parameters are on meta too."""
    dtype = resolve_dtype(dtype, config)
    cls = resolve_class(config, model_class)
    with _default_dtype(dtype), _params_on_meta():
        model = construct(config, cls)
        if adapt is not None:
            model = adapt(model)
    buffers = {n: b for n, b in model.named_buffers(remove_duplicate=False)}
    pnames = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    persistent = {k for k in model.state_dict(keep_vars=True) if k not in pnames}
    model.to("meta")
    return Built(model, buffers, persistent, config)
