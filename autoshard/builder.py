"""Build a Hugging Face model (on meta by default) from a model, a config or a folder."""

from __future__ import annotations

import os

import torch

from .errors import ConfigError

__all__ = ["model_from"]


def model_from(obj, *, meta: bool = True):
    """A model (on meta when built here) from a model, a config, or a local path."""
    import transformers

    if isinstance(obj, torch.nn.Module):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        obj = transformers.AutoConfig.from_pretrained(obj)
    config = obj
    archs = getattr(config, "architectures", None) or []
    cls = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), None)
    ctx = torch.device("meta") if meta else torch.device("cpu")
    with ctx:
        if cls is not None:
            return cls(config)
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM, transformers.AutoModel):
            try:
                return auto.from_config(config)
            except ValueError:
                continue
    raise ConfigError(f"cannot build a model for config {type(config).__name__}")
