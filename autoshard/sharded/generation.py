"""``generate()`` on a sharded module: the prompt checked and padded to the batch split,
the cache length chosen, then Hugging Face's ``generate`` run over the step graphs of
:mod:`autoshard.generate` (a static KV cache sharded as the plan shards attention)."""

from __future__ import annotations

import torch

from ..ir.errors import ConfigError
from ..ir.plan import ShardingPlan
from ..ir.signature import pad_rows, trim_rows

__all__ = ["generate", "feature_rows", "generation_plan"]


def generate(sharded, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, *,
             max_len: int | None = None, input_features: torch.Tensor | None = None, **kwargs):
    """What :meth:`~autoshard.module.ShardedModule.generate` runs (see there); refused
    before any collective on a module with ``cp > 1``."""
    from ..generate import LEN_QUANTUM, sharded_lm

    if sharded.mesh.cp > 1:
        raise ConfigError(f"generate() on a module sharded with cp={sharded.mesh.cp}: a decode step holds "
                          f"one token, which the sequence split cannot share; generate with a module sharded "
                          f"without cp (the same weights: save_checkpoint, then shard(..., cp=1))")

    if input_features is not None:
        rows, p = feature_rows(sharded, input_features.to(sharded.device)), 1      # decoding from the start token
    else:
        if input_ids is None:
            raise ConfigError("generate() takes input_ids [batch, prompt length] (or input_features for a "
                              "speech encoder-decoder)")
        input_ids = input_ids.to(sharded.device)
        if input_ids.dim() != 2:
            raise ConfigError(f"generate() takes input_ids [batch, prompt length], got shape "
                              f"{list(input_ids.shape)}")
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(sharded.device)
        rows, p = {"input_ids": input_ids, "attention_mask": mask}, input_ids.shape[1]
    b = next(iter(rows.values())).shape[0]
    gc = kwargs.get("generation_config") or sharded.generation_config
    new = kwargs.get("max_new_tokens") or gc.max_new_tokens or max(int(gc.max_length or 20) - p, 1)
    need = p + int(new)
    if max_len is None:
        max_len = -(-need // LEN_QUANTUM) * LEN_QUANTUM
        lim = sharded.limits.get("max_positions")
        if lim and max_len > lim[1]:
            max_len = max(need, lim[1])
    if need > max_len:
        raise ConfigError(f"generate(): prompt {p} + {new} new tokens need {need} cache positions, "
                          f"max_len={max_len}")
    sample = kwargs.get("do_sample")
    if sample is None:
        sample = getattr(gc, "do_sample", False)
    if sample:
        from ..runtime.groups import check_same_rng

        check_same_rng(sharded.mesh.size(sharded.mesh.axes), "generate(do_sample=True)",
                       "the ranks would sample different tokens", "before generate()")
    split = sharded.batch_split
    padded = b + (-b % split)
    # rows beyond the batch: copies of the last prompt, cut from every output
    rows = pad_rows(rows, b, padded, tuple(rows))
    lm, cache = sharded_lm(sharded, max_len=max_len, batch=padded)
    out = lm.generate(**rows, past_key_values=cache, **kwargs)
    return out if padded == b else trim_rows(out, b, padded)


def feature_rows(sharded, features: torch.Tensor) -> dict:
    """:func:`generate`'s inputs for an encoder-decoder led by log-mel frames
    ``[batch, mel bins, frames]`` (Whisper)."""
    from ..generate import is_encoder_decoder

    if not is_encoder_decoder(sharded.config) or features.dim() != 3:
        raise ConfigError(f"generate(input_features=...) takes an encoder-decoder's log-mel frames [batch, mel "
                          f"bins, frames]; got shape {list(features.shape)} for {type(sharded).__name__} "
                          f"(encoder-decoder: {is_encoder_decoder(sharded.config)})")
    return {"input_features": features}


def generation_plan(sharded, step: str = "decode", max_len: int | None = None) -> ShardingPlan:
    """The plan of one of ``sharded``'s step graphs (see
    :meth:`~autoshard.module.ShardedModule.generation_plan`)."""
    graphs = sharded.generator.graphs
    keys = [k for k in graphs if k[0] == (step == "prefill") and (max_len is None or k[1] == max_len)]
    if step not in ("decode", "prefill") or not keys:
        raise ConfigError(f"no {step!r} step graph" + (f" for max_len={max_len}" if max_len else "")
                          + f"; steps: 'decode', 'prefill'; captured: "
                          f"{sorted(('prefill' if k[0] else 'decode', k[1]) for k in graphs) or 'none (call generate first)'}")
    return graphs[keys[-1]][1]
