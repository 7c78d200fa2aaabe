"""Capture a Hugging Face model as an ATen-level fx graph with ``torch.export``.

Non-strict export in the model's current mode (train or eval), with dynamic
batch and sequence dims shared by every ``[batch, seq]`` input, ``use_cache=False``
for decoders, and ``labels`` passed as its own tensor (the same tensor for
``input_ids`` and ``labels`` would be aliased into one graph input). Works on
real and meta weights.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import Dim

from autoshard.ir.errors import CaptureError, ConfigError
from autoshard.ir.signature import MAIN_INPUTS, NOT_TOKENS, batch_of, main_input, pad_rows, seq_input, seq_of

__all__ = ["Captured", "capture", "default_example_inputs", "copy_sharing", "input_symbols", "unlift"]


@dataclass
class Captured:
    """The exported program, its unlifted module (rewrite target) and input facts."""

    program: Any                    # torch.export.ExportedProgram
    module: torch.fx.GraphModule    # program.module(): parameters as get_attr
    model_name: str
    input_names: tuple[str, ...]
    constants: dict                 # non-tensor kwargs baked in (use_cache=False); those not in input_names
                                    # are bound into forward, not graph inputs (see bound_constants)
    batch_symbol: Any               # sympy symbol of the batch dim
    seq_symbol: Any
    example_inputs: dict
    training: bool
    config: Any = None              # the model's Hugging Face config (None for a plain module)
    seq_range: tuple = (2, 4096)    # sequence lengths the graph was proven for (calls outside are refused;
                                    # lo == hi: a static sequence, one graph per length)
    padding: tuple = ()             # passes.pad.Padding records: the vocabulary padded in ``module``
    guards: tuple = ()              # (code, input paths) export's _guards_fn was built from (see unlift)
    stamped: bool = False           # layers copied from a shallower export (passes.stamp)
    shallow: Any = None             # passes.stamp.Shallow: that export, which the search prices on


def _max_positions(model) -> int:
    """The longest sequence the model takes: its config's positions, else an attribute of
    the module itself (a plain module's ``max_seq_len``), else 4096."""
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None), getattr(config, "decoder", None), model):
        for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_target_positions"):
            v = getattr(c, key, None) if c is not None else None
            if isinstance(v, int) and v > 2:
                return v
    return 4096


def _sub(config, name: str):
    """``config.<name>_config`` where a multi-modal config nests one, else ``config``."""
    sub = getattr(config, f"{name}_config", None)
    return sub if sub is not None else config


def _classifies(model) -> bool:
    """A classification head: one label per sample (``[batch]`` labels)."""
    name = type(model).__name__
    return name.endswith("Classification") and not name.endswith("TokenClassification")


def default_example_inputs(model, *, batch_size: int = 2, seq_len: int = 8, labels: bool = True) -> dict:
    """The inputs the model's forward is led by, made from its config: token ids
    (``input_ids``, ``attention_mask``), images (``pixel_values``), log-mel features
    (``input_features``), raw audio (``input_values``), and ``labels`` of the kind its
    head takes.

    Classification heads get ``[batch]`` labels; models with a token head get
    ``[batch, seq]`` token labels (an encoder-decoder shifts them into its decoder's
    inputs); a model that takes images and text (a contrastive dual encoder) gets
    ``return_loss=True``; one that merges image features into its tokens (LLaVA-like,
    its config names an image token) gets each row opened by that image's placeholder
    tokens, unlabelled.

    >>> from transformers import ViTConfig, ViTForImageClassification
    >>> m = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
    ...                                          intermediate_size=64, image_size=8, patch_size=4))
    >>> {k: tuple(v.shape) for k, v in default_example_inputs(m).items()}
    {'pixel_values': (2, 3, 8, 8), 'labels': (2,)}"""
    config = getattr(model, "config", None)
    if config is None:
        names = _tensor_params(model)
        raise ConfigError(f"{type(model).__name__} has no Hugging Face config to make example inputs from: pass "
                          f"example_inputs, a batch as its forward takes it: a tuple "
                          f"({', '.join(names) or '...'},) or a dict "
                          f"{{{', '.join(repr(n) + ': ...' for n in names) or '...'}}}")
    params = inspect.signature(model.forward).parameters
    g = torch.Generator().manual_seed(0)
    out: dict = {}
    text = _sub(config, "text")
    vocab = int(getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or 100)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    image_token, n_image = _image_placeholders(model, params)
    if image_token is not None:
        # a vision-language model: each row opens with its image's placeholder tokens, which
        # the model replaces with the projected image features (no text token equals them)
        ids = torch.where(ids == image_token, (image_token + 1) % vocab, ids)
        ids = torch.cat([torch.full((batch_size, n_image), image_token, dtype=ids.dtype), ids], dim=1)
    if "input_ids" in params:
        out["input_ids"] = ids
        if "attention_mask" in params:
            out["attention_mask"] = torch.ones(*ids.shape, dtype=torch.long)
    if "pixel_values" in params:
        vis = _sub(config, "vision")
        size = getattr(vis, "image_size", 224)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        out["pixel_values"] = torch.randn(batch_size, int(getattr(vis, "num_channels", 3)), *size, generator=g)
    if "input_features" in params:
        out["input_features"] = torch.randn(batch_size, *log_mel_shape(config), generator=g)
    if "input_values" in params and not out:
        out["input_values"] = torch.randn(batch_size, 16 * seq_len, generator=g)
    if not out:
        raise ConfigError(f"{type(model).__name__}.forward takes none of the inputs autoshard can make "
                          f"(input_ids, pixel_values, input_features, input_values): pass example_inputs")
    if "return_loss" in params and "input_ids" in out and "pixel_values" in out:
        out["return_loss"] = True
    elif labels and "labels" in params:
        if _classifies(model):
            out["labels"] = torch.randint(0, max(int(getattr(config, "num_labels", 2)), 1), (batch_size,), generator=g)
        else:
            out["labels"] = ids.clone()
            if image_token is not None:
                out["labels"][:, :n_image] = -100         # no loss on the image's placeholders
    return out


def _tensor_params(model) -> list[str]:
    """The names of ``model.forward``'s parameters without a default (what a call must give)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def log_mel_shape(config) -> tuple[int, int]:
    """``(mel bins, frames)`` of a speech encoder's input: its positions × its conv stride (2) frames."""
    return int(getattr(config, "num_mel_bins", 80)), 2 * int(getattr(config, "max_source_positions", 1500))


def _image_placeholders(model, params) -> tuple[int | None, int]:
    """A model that merges image features into its token sequence (LLaVA-like: it takes
    ``input_ids`` and ``pixel_values`` and names an image token): that token and the
    number of features one image becomes (``image_seq_length`` or ``mm_tokens_per_image``,
    else one per patch)."""
    config = model.config
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None or "input_ids" not in params or "pixel_values" not in params:
        return None, 0
    n = getattr(config, "image_seq_length", None)
    if n is None:
        n = getattr(config, "mm_tokens_per_image", None)      # Gemma-3: the pooled features per image
    if n is None:
        vis = _sub(config, "vision")
        size, patch = getattr(vis, "image_size", 224), getattr(vis, "patch_size", 14)
        size = size[0] if isinstance(size, (list, tuple)) else size
        n = (size // (patch[0] if isinstance(patch, (list, tuple)) else patch)) ** 2
    return int(token), int(n)


def _capture_failure(name: str, e: Exception, lo: int, hi: int, inputs=()) -> str:
    """The message of a failed capture: where in the model's code (file, line, the line
    itself), what construct export cannot trace there and what would make it capturable
    (:func:`model_line`), then torch's explanation (its guard), not just its first line."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    keep = [ln for ln in lines if not ln.startswith(("The error above occurred", "For more information"))][:12]
    where = model_line(e, str(e), inputs)
    return (f"torch.export could not capture {name} with sequence lengths {lo}..{hi}"
            + (f": {where}" if where else "") + f"\n  torch: {type(e).__name__}: " + "\n  ".join(keep))


def _frames(e: BaseException):
    """The traceback frames of ``e`` and of the exceptions it was raised from, innermost last."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    out = []
    for x in reversed(chain):
        tb = x.__traceback__
        while tb is not None:
            out.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
            tb = tb.tb_next
    return out


_OURS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
              for d in ("autoshard", "passes", "policies")) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


def _outside_torch(path: str) -> bool:
    """A frame of the model's code: not torch's, not autoshard's, not Python's own."""
    parts = path.replace("\\", "/").split("/")
    lib = "site-packages" in parts or "dist-packages" in parts
    return not (("torch" in parts and lib) or path.startswith(_OURS) or path.startswith("<")
                or ("/lib/python3" in path and not lib))


def _where(e: BaseException, msg: str) -> tuple:
    """``(file, line, code)`` of the innermost frame in the model's code (not torch's, not
    autoshard's), else of the line torch names in ``msg``; ``(None, None, "")`` when neither."""
    import linecache

    hits = [(f, n) for f, n in _frames(e) if _outside_torch(f)]
    path, line = hits[-1] if hits else (None, None)
    named = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.+)', msg)
    if named and (path is None or not any(f == named[-1][0] for f, _ in hits)):
        path, line = named[-1][0], int(named[-1][1])
    if path is None:
        return None, None, ""
    code = (linecache.getline(path, line).strip() if os.path.exists(path) else "") or \
        next((c.strip() for f, n, c in named if f == path and int(n) == line), "")
    return path, line, code


def model_line(e: BaseException, msg: str, inputs=()) -> str:
    """``file:line (`code`)``, the construct export cannot trace and a way around it, for a
    failed capture: the innermost frame of the traceback in the model's code (not torch's,
    not autoshard's), else the line torch names in its message; '' when neither is known.

    >>> msg = 'File "/m/modeling_x.py", line 3, in forward' + chr(10) + '    n = lengths.tolist()'
    >>> print(model_line(ValueError(), msg, ("lengths",)))
    /m/modeling_x.py:3 (`n = lengths.tolist()`): reads a tensor's values as Python numbers (.tolist() / .item()); the line reads input lengths: call the model without it, or give the values as a non-tensor argument"""
    path, line, code = _where(e, msg)
    if path is None:
        return ""
    if re.search(r"\.(tolist|item)\(\)|\bint\(|\bfloat\(", code):
        construct = "reads a tensor's values as Python numbers (.tolist() / .item())"
    elif re.search(r"\b(if|while|assert)\b", code) or "data-dependent" in msg or "GuardOnDataDependent" in msg:
        construct = "branches on a tensor's values (a Python if on data: export traces one path only)"
    else:
        construct = "a construct export cannot trace"
    used = [k for k in inputs if re.search(rf"\b{re.escape(k)}\b", code)]
    fix = (f"the line reads input {', '.join(used)}: call the model without it"
           + (" (compute the loss outside the model from its logits)" if any(k.endswith("labels") for k in used) else "")
           + ", or give the values as a non-tensor argument") if used else \
        "the branch depends on values computed in the model: a static value (a config flag, a non-tensor " \
        "argument) or a tensor op in place of the Python branch makes it capturable"
    return f"{path}:{line} (`{code}`): {construct}; {fix}"


@contextlib.contextmanager
def _no_cache(model, params, kwargs):
    """A model that hands ``use_cache`` to its decoder through ``**kwargs`` (LLaVA-like)
    is captured with its text config's ``use_cache`` off (a cache object is not a graph
    output), restored after."""
    text = _sub(getattr(model, "config", None), "text")
    if "use_cache" in params or "use_cache" in kwargs or not getattr(text, "use_cache", False):
        yield
        return
    text.use_cache = False
    try:
        yield
    finally:
        text.use_cache = True


@contextlib.contextmanager
def _bound(model, bound: dict, inputs: dict | None = None, params=None):
    """``model.forward`` with the keyword arguments ``bound`` fixed, for the export; yields
    the parameters the export matches its inputs to. A tensor ``forward`` takes only
    through ``**kwargs`` (sentence-transformers hands DistilBERT ``token_type_ids``) gets
    a parameter of its own: torch.export cannot match dynamic shapes inside ``**kwargs``."""
    loose = [k for k, v in (inputs or {}).items() if params is not None and k not in params
             and isinstance(v, torch.Tensor)]
    if not bound and not loose:
        yield params
        return
    own = model.__dict__.get("forward")
    call = fixed = functools.partial(model.forward, **bound)
    if loose:
        def named(**kw):
            return fixed(**kw)

        named.__signature__ = inspect.Signature([inspect.Parameter(k, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                                 for k in inputs])
        call = named
    model.forward = call
    try:
        yield inspect.signature(call).parameters
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


# True: every export defers torch's guards to run time, as the capture retry does for a
# guard an older torch cannot prove (tests/passes/test_capture.py forces it on 2.13)
_DEFER_GUARDS = False


def _as_signature(dynamic: dict, params) -> dict:
    """``dynamic`` keyed as torch.export matches it to ``forward``'s parameters: the
    entries ``forward`` takes through ``**kwargs`` go under that parameter's name."""
    var = next((k for k, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if var is None or all(k in params for k in dynamic):
        return dynamic
    out = {k: dynamic[k] for k in params if k in dynamic}      # in the signature's order
    out[var] = {k: v for k, v in dynamic.items() if k not in params}
    return out




def _dynamic(kwargs: dict, b: int | None, s: int | None, min_seq: int, max_seq: int) -> dict:
    """One batch ``Dim`` shared by every input whose dim 0 is the batch, and one
    sequence ``Dim`` by every ``[batch, seq, ...]`` one (``s`` None: no sequence;
    ``b`` None: the batch static)."""
    batch = Dim("batch", min=1, max=1 << 16)
    seq = Dim("seq", min=min_seq, max=max_seq)
    dynamic: dict = {}
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and s is not None and v.dim() >= 2 and v.shape[1] == s \
                and k not in NOT_TOKENS and (b is None or v.shape[0] == b):
            dynamic[k] = {0: batch, 1: seq} if b is not None else {1: seq}
        elif isinstance(v, torch.Tensor) and b is not None and v.dim() >= 1 and v.shape[0] == b:
            dynamic[k] = {0: batch}
        else:
            dynamic[k] = None
    return dynamic


def capture(model: torch.nn.Module, *, example_inputs: dict | None = None, batch_size: int = 2,
            seq_len: int = 8, stack_traces: bool = True) -> Captured:
    """Export ``model`` with dynamic batch and sequence dims. ``stack_traces=False`` leaves
    out each node's source lines (``meta["stack_trace"]``, the comments of the module's
    code), which only a graph that runs shows: a capture for planning alone (a tenth
    of a 3-layer Llama's export).

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> m = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
        >>> cap = capture(m)
        >>> cap.input_names
        ('input_ids', 'attention_mask', 'labels', 'use_cache')
    """
    if batch_size < 2 or seq_len < 2:
        raise ConfigError("capture needs batch_size >= 2 and seq_len >= 2 (0/1 sizes are specialised by export)")
    if batch_size == seq_len:
        seq_len += 1  # distinct sizes keep batch and sequence symbols apart
    params = inspect.signature(model.forward).parameters
    kwargs, b, s = _example_kwargs(model, example_inputs, batch_size, seq_len, params)
    constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    # a non-tensor that forward takes through ``**kwargs`` (``return_dict=True`` on BERT) is
    # bound into forward rather than given to export (whose dynamic-shapes matching fails on
    # it): a constant of the graph, not one of its inputs (``input_names``)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    bound = {k: v for k, v in constants.items() if var_kw and k not in params}
    inputs = {k: v for k, v in kwargs.items() if k not in bound}
    with _stack_traces(stack_traces):
        ep, tries = _export(model, params, kwargs, inputs, bound, b, s)
    gm, guards = unlift(ep)
    bsym, ssym = input_symbols(gm, main_input(kwargs), seq_input(kwargs))
    lo, hi = (s, s) if tries.static_seq else (tries.lo, tries.hi)
    return Captured(program=ep, module=gm, model_name=type(model).__name__, input_names=tuple(inputs),
                    constants=constants, seq_range=(lo, hi), guards=guards,
                    batch_symbol=bsym, seq_symbol=ssym, example_inputs=kwargs, training=model.training,
                    config=getattr(model, "config", None))


def _example_kwargs(model, example_inputs, batch_size: int, seq_len: int, params) -> tuple[dict, int, int]:
    """(the example inputs export runs on, their batch size, their sequence length): the
    caller's or the model's defaults, on the weights' device, ``use_cache=False``, and
    at least two rows, their count apart from the sequence length."""
    kwargs = dict(example_inputs) if example_inputs else default_example_inputs(
        model, batch_size=batch_size, seq_len=seq_len)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "meta":       # plan-only capture: inputs live where the weights do
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    if "use_cache" in params and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    if main_input(kwargs) is None:
        raise ConfigError(f"example_inputs must contain a main input (one of {', '.join(MAIN_INPUTS)}), "
                          f"got {sorted(kwargs)}")
    b, s = batch_of(kwargs), seq_of(kwargs)
    if b < 2 or b == s:     # export specialises a batch of 1 and merges equal sizes: capture with more rows
        grow = max(b, 2) + (max(b, 2) == s)
        kwargs = pad_rows(kwargs, b, grow, [k for k, v in kwargs.items()
                                            if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == b])
        b = grow
    return kwargs, b, s


@dataclasses.dataclass
class _Tries:
    """What the export retries have narrowed so far: the sequence range, the dims
    captured static, whether guards are deferred to run time."""

    lo: int
    hi: int
    deferred: bool
    static_batch: bool = False
    static_seq: bool = False


def _export(model, params, kwargs: dict, inputs: dict, bound: dict, b: int, s: int | None):
    """(the exported program, the :class:`_Tries` it took).

    Export proves the graph for a range of sequence lengths. Two guards models are
    known to add narrow it, each retried once: encoder-decoders shift the labels
    right (a slice of seq - 1: seq >= 3), and some attention code compares seq with
    the model's maximum (GPT-Neo's local attention: seq != max_positions).
    A model that reads a size as a Python int (CLIP's contrastive loss takes
    len(logits); Mamba's scan loops over the sequence) makes export specialise it:
    that dim is then captured static, a graph for this size only (no mode may split
    a static batch: passes/pipeline.py; a module captures one graph per static
    sequence length it is called with)."""
    name = type(model).__name__
    t = _Tries(lo=2, hi=_max_positions(model), deferred=_DEFER_GUARDS)
    for _ in range(6):
        try:
            with _no_cache(model, params, kwargs), _bound(model, bound, inputs, params) as sig, _lazy_code():
                ep = torch.export.export(model, (), inputs, strict=False, dynamic_shapes=_as_signature(_dynamic(
                    inputs, None if t.static_batch else b, None if t.static_seq else s, t.lo, t.hi), sig),
                    prefer_deferred_runtime_asserts_over_guards=t.deferred)
            return ep, t
        except Exception as e:  # noqa: BLE001 - re-raised with the model and torch's explanation
            if not _narrow(t, str(e), s):
                eager = _eager_failure(model, params, kwargs, inputs, bound)
                if eager is not None:
                    raise CaptureError(_eager_message(name, eager)) from eager
                raise CaptureError(_capture_failure(name, e, t.lo, t.hi, tuple(inputs))) from e
    raise CaptureError(f"torch.export could not capture {name} for any sequence range tried (last {t.lo}..{t.hi})")


@contextlib.contextmanager
def _stack_traces(on: bool):
    """Tracing records each node's source lines or not (``torch.fx.config``, restored after)."""
    from torch.fx import config

    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = before or not on
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def _lazy_code():
    """Export's own passes recompile its intermediate graph modules a dozen times; lazily
    (``_LazyGraphModule``: their code is written when read or run) the export takes 5%
    less time and gives the same program (``ep.module()`` is an ordinary GraphModule)."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def _eager_failure(model, params, kwargs: dict, inputs: dict, bound: dict) -> Exception | None:
    """The error ``model`` raises run eagerly (no grad) on the inputs export failed on, or
    None when it runs: a model that fails eagerly too is not export's limitation (a
    config whose sizes do not fit together). On meta weights an error about meta
    tensors themselves (``.item()`` on meta) is export's case, not the model's."""
    try:
        with torch.no_grad(), _no_cache(model, params, kwargs), _bound(model, bound):
            model(**inputs)
    except Exception as e:  # noqa: BLE001 - reported, with the model's line, by the caller
        return None if "meta" in str(e) else e
    return None


def _eager_message(name: str, e: Exception) -> str:
    """The message of a capture whose model fails eagerly as well: the model's line and
    its error, named as the model's own (not what export cannot trace)."""
    path, line, code = _where(e, str(e))
    first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
    return (f"{name} fails when run eagerly on its example inputs too (not a torch.export limitation): "
            + (f"{path}:{line} (`{code}`): " if path else "") + f"{type(e).__name__}: {first}; check that the config's sizes "
            "fit together (heads · head width against the hidden or inner width)")


def _narrow(t: _Tries, msg: str, s: int | None) -> bool:
    """Update ``t`` from export's failure ``msg`` for another try; False when no retry helps."""
    constant = "specialized it to be a constant" in msg
    if "satisfy the generated guard min(" in msg and not t.deferred:
        # an older torch (2.11) cannot prove min(16·seq, 32·seq) == 16·seq over the
        # range (a GQA model's masks): checked when the graph runs instead
        t.deferred = True
        return True
    # with guards deferred, a specialised dim shows as its suggested fix ("batch = 2")
    pinned = set(re.findall(r"^\s*(batch|seq) = \d+\s*$", msg, re.M))
    if "Constraints violated (batch" in msg and (constant or "batch" in pinned) and not t.static_batch:
        t.static_batch = True
        return True
    if s is None or "Constraints violated (seq)" not in msg:
        return False
    if (constant or "seq" in pinned) and not t.static_seq:
        t.static_seq = True
        return True
    fix = re.search(r"seq = Dim\('seq', (?:min=(\d+))?,? ?(?:max=(\d+))?\)", msg)
    if fix is not None:
        # the model checks the length itself (``if seq_len > self.max_seq_len: raise``):
        # the range torch proposes, where it holds the example's length
        new_lo, new_hi = int(fix.group(1) or t.lo), int(fix.group(2) or t.hi)
        if (new_lo, new_hi) != (t.lo, t.hi) and max(new_lo, 2) <= s <= new_hi and new_hi > max(new_lo, 2):
            t.lo, t.hi = max(new_lo, 2), new_hi
            return True
    excluded = [int(n) for n in re.findall(r"size\(\)\[1\] != (\d+)", msg)]
    if t.hi in excluded and t.hi - 1 >= max(t.lo, s):
        t.hi -= 1
        return True
    if t.lo == 2 and s >= 3 and t.hi not in excluded:
        t.lo = 3
        return True
    return False


def unlift(ep) -> tuple:
    """``(ep.module(), guards)``: the unlifted module and what export built its input
    guards (the ``_guards_fn`` submodule) from, ``(guard code lines, input paths)``, so
    that another process can rebuild them (:mod:`autoshard.launch.capture_share` sends the
    graph, not the program); ``()`` where this torch builds no guards that way."""
    from torch.export import _unlift

    build = getattr(_unlift, "_convert_guards_code_to_fn", None)
    if build is None:
        return ep.module(), ()
    seen: list = []

    def recording(code, paths):
        seen.append((tuple(code), tuple(paths)))
        return build(code, paths)

    _unlift._convert_guards_code_to_fn = recording
    try:
        gm = ep.module()
    finally:
        _unlift._convert_guards_code_to_fn = build
    return gm, (seen[-1] if seen else ())


def input_symbols(gm: torch.fx.GraphModule, main: str = "input_ids", seq: str | None = "input_ids") -> tuple:
    """The sympy symbols of the batch dim of input ``main`` and the sequence dim of input
    ``seq`` in an exported graph (None for a static dim or no such input)."""
    vals = {n.name: n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"}

    def sym(name, i):
        v = vals.get(name) if name else None
        d = v.shape[i] if isinstance(v, torch.Tensor) and v.dim() > i else None
        return d.node.expr if isinstance(d, torch.SymInt) else None

    return sym(main, 0), sym(seq, 1)


def copy_sharing(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` (graph and modules) holding the very parameter and buffer tensors
    of ``gm``: what a graph-normalising pass edits, leaving the capture it was given as is."""
    memo = {id(t): t for _, t in list(gm.named_parameters(remove_duplicate=False))
            + list(gm.named_buffers(remove_duplicate=False))}
    return copy.deepcopy(gm, memo)


def fold_nodes(cap: "Captured", foldable, fold) -> "Captured":
    """``cap`` with every node ``n`` for which ``foldable(n)`` holds replaced by
    ``fold(n)``, the ``(target, args)`` of a call computing the same values (the
    graph-normalising passes: :mod:`~autoshard.passes.experts`,
    :mod:`~autoshard.passes.linear_fold`). Operands the replaced node alone used are
    erased. ``cap`` itself when no node matches; otherwise ``cap`` is not changed:
    the result holds a copy of its graph module sharing every parameter and buffer."""
    gm = cap.module
    if not any(foldable(n) for n in gm.graph.nodes):
        return cap
    new = copy_sharing(gm)
    g = new.graph
    for n in list(g.nodes):
        if not foldable(n):
            continue
        target, args = fold(n)
        with g.inserting_before(n):
            r = g.call_function(target, args)
        r.meta = dict(n.meta)
        n.replace_all_uses_with(r)
        old = [a for a in n.all_input_nodes if a.op == "call_function"]
        g.erase_node(n)
        for a in old:
            if not a.users:
                g.erase_node(a)
    g.lint()
    new.recompile()
    return dataclasses.replace(cap, module=new)
