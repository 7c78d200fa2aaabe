"""A shrunk copy of a Hugging Face config that keeps every split the real layout makes.

``autoshard verify`` runs a real architecture on a few CPU ranks in seconds: it
builds a random-init model of the *same* class with the *same* config switches
(activation, norms, rope, tied embeddings, layer pattern, experts...) but tiny
sizes. :func:`shrink` picks those sizes so that the layout on the shrunk model
cuts exactly as it cuts the real one: every dimension a policy splits keeps its
residue modulo the split (a dimension that divides still divides, one that does
not is still padded or refused the same way) and is at least the split, so every
rank still holds a share: :func:`~autoshard.planning.validate.check_dims` finds the
same problems in both (docs/design.md, "Layouts").

Only sizes named by Hugging Face attribute names (and the aliases of
``config.attribute_map``) are touched: heads, kv heads, head dims, hidden,
MLP widths, low-rank (MLA) widths, vocabulary and special token ids, layer counts
and per-layer lists, expert counts. Everything else is kept as it is.

Example: Llama-2-7B laid out 1d over 8 ranks.

    >>> from transformers import LlamaConfig
    >>> from autoshard.policies import make_policy
    >>> real = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    ...                    num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
    >>> s = shrink(real, make_policy("1d", 8))
    >>> print(s.describe())
    num_attention_heads 32→8, num_key_value_heads 32→8, head_dim 128→8, hidden_size 4096→64, intermediate_size 11008→176, vocab_size 32000→64, num_hidden_layers 32→2
    >>> s.config.hidden_size, real.hidden_size
    (64, 4096)
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..ir.errors import ConfigError
from .validate import check_dims

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["Shrunk", "shrink", "shrink_that_runs"]

# Hugging Face attribute names, canonical first; aliases resolve through config.attribute_map.
_HEADS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads")
_OTHER_HEADS = ("decoder_attention_heads",)
_KV_HEADS = ("num_key_value_heads", "num_kv_heads")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_HEAD_DIM = ("head_dim",)
_HEAD_WIDTHS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")     # multi-head latent attention
_LOW_RANK = ("kv_lora_rank", "q_lora_rank")
_MLP = ("intermediate_size", "n_inner", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff",
        "ffn_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size_mlp")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers", "num_decoder_layers")
_LAYER_LISTS = ("layer_types", "no_rope_layers")          # one entry per layer
_LAYER_INDICES = ("mlp_only_layers",)                     # indices of the special layers
_LAYER_PERIODS = ("sliding_window_pattern", "decoder_sparse_step", "moe_layer_freq")   # every k-th layer
_LAYER_PREFIXES = ("first_k_dense_replace",)              # the first k layers are special
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")

_HEAD_DIM_SMALL = 8      # the shrunk head width (even: rotary halves it)
_HIDDEN_SMALL = 32       # the least hidden size when hidden is not heads · head_dim
_VOCAB_SMALL = 64        # the least vocabulary


@dataclass(frozen=True)
class Shrunk:
    """A shrunk config and what changed.

    ``config`` is a deep copy of the real config with sizes shrunk; ``changes``
    lists ``(attribute, real value, shrunk value)`` in the order :func:`shrink`
    decides them (a nested config's attributes as ``text_config.hidden_size``)."""

    config: "PretrainedConfig"
    changes: tuple[tuple[str, object, object], ...]
    note: str = ""

    def describe(self) -> str:
        """One line: ``hidden_size 4096→64, num_hidden_layers 32→2, ...`` (lists by their length)."""
        def show(v):
            return f"[{len(v)} entries]" if isinstance(v, (list, tuple)) else repr(v) if isinstance(v, str) else str(v)

        line = ", ".join(f"{a} {show(old)}→{show(new)}" for a, old, new in self.changes) or "nothing changed"
        return line + (f" ({self.note})" if self.note else "")


def shrink(config, policy, *, min_layers: int = 2, widths: bool = True) -> Shrunk:
    """A copy of ``config`` with tiny sizes that ``policy`` splits as it splits ``config``.

    Args:
        config: a Hugging Face ``PretrainedConfig`` (not modified).
        policy: the :class:`~autoshard.policies.base.Policy` the shrunk model is laid out
            with (:func:`autoshard.policies.make_policy`); its :meth:`dim_splits` and
            :meth:`vocab_multiple` fix the residues the shrunk sizes keep.
        min_layers: the fewest layers kept (never more than the real count).
        widths: shrink heads, head widths, hidden and MLP widths too; False keeps them
            (only layers, vocabulary and experts shrink) for modelling code that ties
            widths in ways no config attribute states (:func:`shrink_that_runs`).

    Returns:
        :class:`Shrunk`: the copy and the list of changes. :func:`check_dims` finds the
        same problems (same dimension, same severity) in both configs.

    Raises:
        ConfigError: no small size keeps a split (heads that are not a multiple of the
            kv heads, an odd hidden size where head widths must stay even, ...).
    """
    if min_layers < 1:
        raise ConfigError(f"min_layers={min_layers} must be >= 1")
    new = copy.deepcopy(config)
    changes: list[tuple[str, object, object]] = []
    _shrink_into(config, new, policy, min_layers, changes, prefix="", widths=widths)
    text = getattr(config, "text_config", None)
    if text is not None and hasattr(text, "attribute_map"):
        sub = shrink(text, policy, min_layers=min_layers, widths=widths)
        new.text_config = sub.config
        changes += [(f"text_config.{a}", old, v) for a, old, v in sub.changes]
        if getattr(config, "vocab_size", None) is None and getattr(text, "vocab_size", None):
            _remap_tokens(config, new, sub.config.vocab_size, changes, "")
    return Shrunk(config=new, changes=tuple(changes))


def shrink_that_runs(config, policy, cls=None, *, min_layers: int = 2) -> Shrunk:
    """:func:`shrink`, checked by running the shrunk model: a copy that does not run keeps
    the real widths.

    Modelling code ties sizes together in ways no config attribute states: CodeGen
    splits its heads over 4 fixed groups, a Mamba-2 mixer's heads · head width is
    ``expand · hidden``, PaliGemma's projector maps to the text model's hidden size.
    The shrunk model is built (on CPU: it is small) and run once on
    :func:`~autoshard.passes.capture.default_example_inputs`; when that fails, the
    shrink keeps heads, head widths, hidden and MLP widths (``widths=False``: layers,
    vocabulary and experts still shrink) and says why in :attr:`Shrunk.note`.

    Args:
        config: a Hugging Face ``PretrainedConfig`` (not modified).
        policy: the layout, as for :func:`shrink`.
        cls: the model class (None: the config's ``architectures`` or an Auto class).
        min_layers: as for :func:`shrink`.

    Example:
        >>> from transformers import Mamba2Config
        >>> from autoshard.policies import make_policy
        >>> s = shrink_that_runs(Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, n_groups=1,
        ...     num_hidden_layers=2, vocab_size=64, state_size=8), make_policy("1d", 2))
        >>> s.config.hidden_size, s.config.num_heads * s.config.head_dim
        (64, 128)
    """
    small = shrink(config, policy, min_layers=min_layers)
    err = _run_error(small.config, cls)
    if err is None:
        return small
    kept = shrink(config, policy, min_layers=min_layers, widths=False)
    first = next((ln for ln in str(err).splitlines() if ln.strip()), "")
    return replace(kept, note=f"widths kept: with them shrunk the model fails: {type(err).__name__}: "
                                          f"{first[:160]}")


def _run_error(config, cls) -> Exception | None:
    """What building ``config``'s model and running it once on its default inputs raises, or None."""
    import inspect

    import torch

    from ..io.builder import construct, resolve_class
    from ..passes.capture import default_example_inputs

    try:
        config = copy.deepcopy(config)
        if getattr(config, "use_cache", None):      # as capture runs it: no cache object
            config.use_cache = False
        model = construct(config, cls or resolve_class(config))
        inputs = default_example_inputs(model)
        if "use_cache" in inspect.signature(model.forward).parameters:
            inputs["use_cache"] = False
        with torch.no_grad():
            model(**inputs)
    except Exception as e:  # noqa: BLE001 - the caller keeps the widths and says why
        return e
    return None


# ------------------------------------------------------------------ reading and writing attributes
def _key(config, name: str) -> str:
    """The attribute ``name`` is stored under (``n_embd`` for GPT-2's ``hidden_size``)."""
    return getattr(config, "attribute_map", {}).get(name, name)


def _ints(config, names) -> dict[str, int]:
    """The stored attributes among ``names`` holding a positive int, by stored name, in order."""
    out = {}
    for n in names:
        k = _key(config, n)
        v = getattr(config, k, None)
        if k not in out and isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out[k] = v
    return out


def _first(config, names) -> tuple[str, int] | tuple[None, None]:
    found = _ints(config, names)
    return next(iter(found.items()), (None, None))


def _set(new, key: str, value, changes: list, prefix: str) -> None:
    prop = getattr(type(new), key, None)
    if isinstance(prop, property) and prop.fset is None:      # derived from other fields (Falcon's head_dim)
        return
    old = getattr(new, key)
    if value != old:
        setattr(new, key, value)
        changes.append((prefix + key, old, value))


# ------------------------------------------------------------------ residues
def _fit(target: int, real: int, s: int) -> int:
    """The least ``v >= max(target, s)`` with ``v ≡ real (mod s)``; ``real`` itself when
    it is smaller than the split or no larger than ``target`` (sizes never grow)."""
    if real < s or real <= target:
        return real
    v = max(target, s)
    return v + (real - v) % s


def _keeps(v: int, real: int, s: int) -> bool:
    """Whether ``v`` cuts over ``s`` as ``real`` does: same residue, and at least ``s`` when ``real`` is."""
    return v % s == real % s and (real < s or v >= s)


# ------------------------------------------------------------------ the rules
def _shrink_into(config, new, policy, min_layers: int, changes: list, prefix: str, widths: bool = True) -> None:
    splits = policy.dim_splits()[0]
    if widths:
        scale = _shrink_attention(config, new, splits, changes, prefix)
        _shrink_widths(config, new, splits, scale, changes, prefix)
    vocab = _ints(config, ("vocab_size",)).get("vocab_size")
    if vocab:
        m = math.lcm(splits.get("vocab_size", 1), policy.vocab_multiple())
        _set(new, "vocab_size", _fit(max(2 * m, _VOCAB_SMALL), vocab, m), changes, prefix)
        _remap_tokens(config, new, new.vocab_size, changes, prefix)
    _shrink_layers(config, new, min_layers, changes, prefix)
    _shrink_experts(config, new, max(splits.values(), default=1), changes, prefix)
    want = [(p.what, p.error) for p in check_dims(config, policy)]
    got = [(p.what, p.error) for p in check_dims(new, policy)]
    if want != got:
        raise ConfigError(f"shrink: the shrunk config ({', '.join(f'{a}={v}' for a, _, v in changes)}) "
                          f"would not split as the real one does on {policy.label(policy.mesh)}: "
                          f"real problems {want}, shrunk {got}")


def _shrink_heads(heads: int, kv: int, s_h: int, s_kv: int) -> tuple[int, int]:
    """(heads', kv'): kv' keeps its residue over ``s_kv``, the GQA group is cut to the
    smallest ratio (at least 2 unless it was 1) that keeps heads' residue over ``s_h``."""
    if heads % kv:
        raise ConfigError(f"shrink: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    kv2 = kv if kv <= s_kv else _fit(1, kv, s_kv)
    r = heads // kv
    for r2 in range(min(r, 2), r + s_h + 1):
        if _keeps(kv2 * r2, heads, s_h):
            return kv2 * r2, kv2
        if r == 1:
            break
    raise ConfigError(f"shrink: no head count keeps num_attention_heads={heads} (split {s_h}) with "
                      f"num_key_value_heads {kv}→{kv2} (split {s_kv})")


def _rotary_factors(config) -> set[float]:
    """The partial rotary factors below 1 (top level, or in ``rope_parameters``, per layer type too)."""
    found = [getattr(config, "partial_rotary_factor", None)]
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict):
        found += [rope.get("partial_rotary_factor")]
        found += [v.get("partial_rotary_factor") for v in rope.values() if isinstance(v, dict)]
    return {f for f in found if isinstance(f, (int, float)) and 0 < f < 1}


def _shrink_attention(config, new, splits: dict, changes: list, prefix: str) -> float:
    """Heads, kv heads, head widths and hidden; returns hidden'/hidden (1.0 without a hidden size)."""
    hk, heads = _first(config, _HEADS)
    xk, hidden = _first(config, _HIDDEN)
    if heads is None:
        if hidden is None:
            return 1.0
        s = splits.get("hidden_size", 1)
        hidden2 = _explicit_hidden(hidden, s)
        _set(new, xk, hidden2, changes, prefix)
        return hidden2 / hidden
    s_h = splits.get("num_attention_heads", 1)
    kk, kv = _first(config, _KV_HEADS)
    heads2, kv2 = _shrink_heads(heads, kv or heads, s_h, splits.get("num_key_value_heads", s_h))
    dk, hd = _first(config, _HEAD_DIM)
    derived = hidden is not None and (hd is None or hidden == heads * hd)
    hd_real = hd or (hidden // heads if hidden else _HEAD_DIM_SMALL)
    s_x = splits.get("hidden_size", 1)
    hidden2 = None if hidden is None or derived else _explicit_hidden(hidden, s_x)
    factors = _rotary_factors(config)
    hd2 = None
    for cand in range(_HEAD_DIM_SMALL, _HEAD_DIM_SMALL + 2 * max(s_x, 8) + 1, 2):
        if cand >= hd_real:
            cand = hd_real
        rot_ok = all(int(cand * f) >= 2 and int(cand * f) % 2 == 0 for f in factors)
        if rot_ok and (hidden is None or _keeps(heads2 * cand if derived else hidden2, hidden, s_x)):
            hd2 = cand
            break
        if cand == hd_real:
            break
    if hd2 is None:
        raise ConfigError(f"shrink: no even head width keeps hidden size {hidden} (split {s_x}) with "
                          f"{heads2} heads and rotary factors {sorted(factors)}")
    if derived:
        hidden2 = heads2 * hd2
    _set(new, hk, heads2, changes, prefix)
    for k, v in _ints(config, _OTHER_HEADS).items():
        _set(new, k, heads2 if v == heads else _fit(2, v, s_h), changes, prefix)
    if kk is not None:
        _set(new, kk, kv2, changes, prefix)
    if dk is not None:
        _set(new, dk, hd2, changes, prefix)
    _shrink_head_widths(config, new, hd_real, hd2, changes, prefix)
    if hidden is None:
        return 1.0
    _set(new, xk, hidden2, changes, prefix)
    return hidden2 / hidden


def _explicit_hidden(hidden: int, s: int) -> int:
    """Hidden when it is not heads · head_dim: the least multiple of lcm(s, 8) from 32
    (or the least size from 32 with hidden's residue, when ``s`` does not divide it)."""
    if hidden % s == 0:
        step = math.lcm(s, 8)
        return min(hidden, -(-_HIDDEN_SMALL // step) * step)
    return _fit(_HIDDEN_SMALL, hidden, s)


def _shrink_head_widths(config, new, hd_real: int, hd2: int, changes: list, prefix: str) -> None:
    """Rotary and latent-attention head widths follow the head width."""
    rd = _ints(config, ("rotary_dim",)).get("rotary_dim")
    if rd:
        small = hd2 if rd >= hd_real else min(hd2, max(2, rd * hd2 // hd_real // 2 * 2))
        _set(new, "rotary_dim", small, changes, prefix)
    widths = _ints(config, _HEAD_WIDTHS)
    for k, v in widths.items():
        _set(new, k, min(v, hd2), changes, prefix)
    qk = _ints(config, ("qk_head_dim",)).get("qk_head_dim")
    nope, rope = widths.get("qk_nope_head_dim"), widths.get("qk_rope_head_dim")
    if qk and nope and rope and qk == nope + rope:      # a derived sum the modelling code reads
        _set(new, "qk_head_dim", new.qk_nope_head_dim + new.qk_rope_head_dim, changes, prefix)


def _shrink_widths(config, new, splits: dict, scale: float, changes: list, prefix: str) -> None:
    """MLP widths scale with hidden and keep the intermediate split's residue; low-rank
    widths scale with hidden, to a multiple of 8."""
    s = splits.get("intermediate_size", 1)
    for k, v in _ints(config, _MLP).items():
        _set(new, k, _fit(max(1, math.ceil(v * scale)), v, s), changes, prefix)
    for k, v in _ints(config, _LOW_RANK).items():
        _set(new, k, min(v, max(8, -(-math.ceil(v * scale) // 8) * 8)), changes, prefix)


def _remap_tokens(config, new, vocab: int, changes: list, prefix: str) -> None:
    """Special token ids at or past the shrunk vocabulary move to its top ids
    (largest first: vocab-1, vocab-2, ...), distinct ids staying distinct."""
    keys = [k for k in sorted(vars(config)) if k.endswith(("_token_id", "_token_ids", "_token_index"))]

    def ids(v):
        return [v] if isinstance(v, int) and not isinstance(v, bool) else \
            [i for i in v if isinstance(i, int)] if isinstance(v, (list, tuple)) else []

    every = {i for k in keys for i in ids(getattr(config, k))}
    free = (i for i in range(vocab - 1, -1, -1) if i not in every)
    moved = {i: next(free) for i in sorted((i for i in every if i >= vocab), reverse=True)}
    if not moved:
        return
    for k in keys:
        v = getattr(config, k)
        if isinstance(v, (list, tuple)):
            _set(new, k, type(v)(moved.get(i, i) for i in v), changes, prefix)
        elif ids(v):
            _set(new, k, moved.get(v, v), changes, prefix)


# ------------------------------------------------------------------ layers
def _layer_signature(config, n: int) -> list[tuple]:
    """What tells layer ``i`` apart from the others, from every per-layer setting the config has."""
    cols = []
    for k in _LAYER_LISTS:
        v = getattr(config, k, None)
        if isinstance(v, (list, tuple)) and v:
            cols.append([v[i] if i < len(v) else None for i in range(n)])
    for k in _LAYER_INDICES:
        v = getattr(config, k, None)
        if isinstance(v, (list, tuple)) and v:
            cols.append([i in set(v) for i in range(n)])
    for k, p in _ints(config, _LAYER_PERIODS).items():
        cols.append([i % p for i in range(n)])
    for k, p in _ints(config, _LAYER_PREFIXES).items():
        cols.append([i < p for i in range(n)])
    if getattr(config, "use_sliding_window", False):        # sliding attention from layer max_window_layers on
        for k, p in _ints(config, ("max_window_layers",)).items():
            cols.append([i < p for i in range(n)])
    return list(zip(*cols)) if cols else [()] * n


def _pattern_length(sig: list) -> int:
    """The fewest layers holding the leading special layers and one full period of the rest."""
    n = len(sig)
    for total in range(1, n + 1):
        for lead in range(total):
            p = total - lead
            if all(sig[i] == sig[lead + (i - lead) % p] for i in range(lead, n)):
                return total
    return n


def _shrink_layers(config, new, min_layers: int, changes: list, prefix: str) -> None:
    counts = _ints(config, _LAYERS)
    if not counts:
        return
    n = counts.get(_key(config, "num_hidden_layers"), max(counts.values()))
    keep = min(n, max(_pattern_length(_layer_signature(config, n)), min_layers))
    for k, v in counts.items():
        _set(new, k, min(v, keep), changes, prefix)
    for k in _LAYER_LISTS:
        v = getattr(config, k, None)
        if isinstance(v, (list, tuple)) and len(v) > keep:
            _set(new, k, type(v)(v[:keep]), changes, prefix)
    for k in _LAYER_INDICES:
        v = getattr(config, k, None)
        if isinstance(v, (list, tuple)):
            _set(new, k, type(v)(i for i in v if i < keep), changes, prefix)


# ------------------------------------------------------------------ experts
def _shrink_experts(config, new, s: int, changes: list, prefix: str) -> None:
    """Expert counts keep their residue over the largest split (experts may be split over
    tp), stay above the routed top-k (when the real count is), and stay divisible by the
    router's groups with at least 2 experts a group (when the real count was)."""
    topk = _ints(config, ("num_experts_per_tok",)).get("num_experts_per_tok")
    groups = _ints(config, ("n_group",)).get("n_group", 1)
    topk_group = _ints(config, ("topk_group",)).get("topk_group")
    for k, e in _ints(config, _EXPERTS).items():
        if topk is None:
            least = 2
        else:
            least = topk + 1 if topk < e else topk
        v = max(least, s, 1)
        while v < e and not (_keeps(v, e, s) and v % groups == 0 and v // groups >= min(2, e // groups)
                             and (topk is None or topk_group is None or topk <= topk_group * (v // groups))):
            v += 1
        _set(new, k, min(v, e), changes, prefix)
