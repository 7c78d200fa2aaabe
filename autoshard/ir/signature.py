"""What a call of a sharded module brings, and how any batch size runs exactly.

A captured graph is specialised to one *input signature*: which keyword
arguments are tensors (with their dtype and their dims: ``b`` the dynamic
batch, ``s`` the dynamic sequence, or a static size) and the values of the
non-tensor ones (``use_cache=False``, ``output_hidden_states=True``). A
:class:`~autoshard.module.ShardedModule` keeps one graph per signature, as
``torch.compile`` keeps one per guard set, and captures a new one when a call
brings a signature no graph has (:meth:`InputSignature.of`).

A batch that does not divide the mesh's batch split is padded to the next
multiple (:func:`pad_rows`: copies of the last row, labels ``-100``) and the
padded rows are cut from every output (:func:`trim_rows`). That is exact when
nothing in the graph reduces over the batch except losses that ignore label
``-100`` (:func:`pad_blocker` finds what else does).

    >>> import torch
    >>> sig = InputSignature.of({"input_ids": torch.zeros(3, 5, dtype=torch.long), "use_cache": False})
    >>> sig.describe()
    'input_ids[b,s]:int64, use_cache=False'
    >>> out = pad_rows({"input_ids": torch.tensor([[1, 2], [3, 4], [5, 6]]), "labels": torch.tensor([[1, 2], [3, 4], [5, 6]])},
    ...                3, 4, {"input_ids", "labels"})
    >>> out["input_ids"].tolist(), out["labels"][3].tolist()
    ([[1, 2], [3, 4], [5, 6], [5, 6]], [-100, -100])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from torch import fx

import torch

__all__ = ["InputSignature", "SignatureGraph", "Recipe", "IGNORE_INDEX", "MAIN_INPUTS", "SEQ_INPUTS", "NOT_TOKENS", "main_input",
           "seq_input", "batch_of", "seq_of", "pad_rows", "trim_rows", "pad_blocker", "batch_inputs"]

IGNORE_INDEX = -100     # the label value Hugging Face losses (and torch's cross-entropy) ignore

# The inputs a Hugging Face model's call is led by, per modality: text ids, embeddings,
# images, log-mel features (Whisper), raw audio. The first one present is the *main
# input*: its dim 0 is the batch every other batched input shares.
MAIN_INPUTS = ("input_ids", "inputs_embeds", "pixel_values", "input_features", "input_values",
               "decoder_input_ids")
# The token inputs whose dim 1 is the dynamic sequence, in the order one is looked for
# (a vision model has none; Whisper's decoder tokens come as ``labels`` or ``decoder_input_ids``).
SEQ_INPUTS = ("input_ids", "inputs_embeds", "decoder_input_ids", "labels")


def main_input(kwargs: Mapping[str, Any]) -> str | None:
    """The name of the call's main input (see :data:`MAIN_INPUTS`), or None.

    A call of a module that is not a Hugging Face model names its inputs as it likes
    (``tokens``, ``x``): there the first tensor with a batch dim leads, in the call's
    order (one of two dims or more first), never a label, target or mask.

    >>> main_input({"pixel_values": torch.zeros(2, 3, 8, 8), "labels": torch.zeros(2)})
    'pixel_values'
    >>> main_input({"target": torch.zeros(2), "mask": torch.ones(2, 5), "tokens": torch.zeros(2, 5)})
    'tokens'"""
    hf = next((k for k in MAIN_INPUTS if isinstance(kwargs.get(k), torch.Tensor) and kwargs[k].dim() >= 1), None)
    if hf is not None:
        return hf
    batched = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() >= 1]
    return next((k for k in batched if not _secondary(k) and kwargs[k].dim() >= 2),
                next((k for k in batched if not _secondary(k)), None))


def _secondary(name: str) -> bool:
    """An input that follows a main one (a target, a mask), by the names the field uses."""
    return name.endswith(("labels", "label", "target", "targets", "mask"))


def seq_input(kwargs: Mapping[str, Any]) -> str | None:
    """The input whose dim 1 is the sequence (see :data:`SEQ_INPUTS`): a ``[batch, seq]``
    (or ``[batch, seq, hidden]`` embeddings) tensor with the main input's batch; None for a
    call with no token sequence (an image or audio classifier)."""
    b = batch_of(kwargs)
    for k in SEQ_INPUTS:
        v = kwargs.get(k)
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == b and \
                (k == "inputs_embeds" or v.dim() == 2) and (k != "labels" or not v.is_floating_point()):
            return k
    main = main_input(kwargs)
    if main is not None and main not in MAIN_INPUTS:     # a plain module: token ids [batch, seq] under its own name
        v = kwargs[main]
        if v.dim() == 2 and not v.is_floating_point() and not v.is_complex() and v.dtype != torch.bool:
            return main
    return None


def batch_of(kwargs: Mapping[str, Any]) -> int | None:
    """The call's batch size: dim 0 of its main input (None without one)."""
    k = main_input(kwargs)
    return int(kwargs[k].shape[0]) if k is not None else None


def seq_of(kwargs: Mapping[str, Any]) -> int | None:
    """The call's sequence length: dim 1 of :func:`seq_input` (None without one)."""
    k = seq_input(kwargs)
    return int(kwargs[k].shape[1]) if k is not None else None


# inputs whose dim 1 is never the token sequence (channels, mel bins), even when its size is the sequence's
NOT_TOKENS = frozenset({"pixel_values", "input_features", "input_values"})


def _dims(t: torch.Tensor, b: int | None, s: int | None, name: str = "") -> tuple:
    out = []
    for i, d in enumerate(t.shape):
        d = int(d)
        out.append("b" if i == 0 and d == b else "s" if i == 1 and d == s and name not in NOT_TOKENS else d)
    return tuple(out)


@dataclass(frozen=True)
class InputSignature:
    """The rank-independent key of a call: tensors as ``(name, dtype, dims)``, the
    other keyword arguments as ``(name, repr(value))``; ``None`` values are left out
    (Hugging Face treats them as absent)."""

    tensors: tuple = ()
    constants: tuple = ()

    @classmethod
    def of(cls, kwargs: Mapping[str, Any], *, static_batch: bool = False, static_seq: bool = False) -> "InputSignature":
        """``static_batch`` / ``static_seq``: the batch size / sequence length is part of
        the signature (export had to specialise the graph to it, see
        :mod:`autoshard.passes.capture`), not the ``b`` / ``s`` of any size."""
        b, s = None if static_batch else batch_of(kwargs), None if static_seq else seq_of(kwargs)
        tensors, constants = [], []
        for k in sorted(kwargs):
            v = kwargs[k]
            if v is None:
                continue
            if isinstance(v, torch.Tensor):
                tensors.append((k, str(v.dtype).removeprefix("torch."), _dims(v, b, s, k)))
            else:
                constants.append((k, repr(v)))
        return cls(tuple(tensors), tuple(constants))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t[0] for t in self.tensors)

    def describe(self) -> str:
        parts = [f"{n}[{','.join(str(d) for d in dims)}]:{dt}" for n, dt, dims in self.tensors]
        return ", ".join(parts + [f"{n}={v}" for n, v in self.constants])


@dataclass(frozen=True)
class Recipe:
    """How :func:`autoshard.shard` made a module: what a new input signature needs to
    be captured, planned and rewritten alike (:mod:`autoshard.launch.recapture`)."""

    model_class: type
    config: Any
    training: bool
    policy: Any
    batch_size: int
    seq_len: int
    gather_outputs: bool
    dropout: str
    activation_checkpointing: bool = False
    adapt: Any = None       # model -> model: what a model rebuilt from the config needs (peft adapters)
    skeleton: Any = None    # a module with no config: its copy on meta (autoshard.io.builder.skeleton),
                            # what a new signature is captured from


@dataclass
class SignatureGraph:
    """One captured input signature: its rewritten graph and what a call needs."""

    gm: fx.GraphModule
    plan: Any      # autoshard.ir.plan.ShardingPlan
    input_names: tuple
    constants: dict
    signature: InputSignature
    batch_inputs: frozenset
    pad_blocker: str | None
    static_seq: bool = False    # export made the sequence static: this graph runs one length

    @property
    def static_batch(self) -> int | None:
        """The one batch size this graph runs, where export made its batch static (no
        input has the dynamic batch); None for a graph of any batch size."""
        if self.batch_inputs:
            return None
        dims = {name: d for name, _, d in self.signature.tensors}
        main = next((k for k in MAIN_INPUTS if k in dims and dims[k]), None)
        return dims[main][0] if main is not None else None

    def accepts(self, kwargs: dict) -> dict | None:
        """The full keyword arguments of this graph for ``kwargs``, or None if the
        call's signature is another one."""
        bound = {k: v for k, v in self.constants.items() if k not in self.input_names}
        for k, v in bound.items():      # bound into the graph's forward (passes/capture.py): the call's own
            if k not in kwargs or isinstance(kwargs[k], torch.Tensor) or repr(kwargs[k]) != repr(v):
                return None
        if set(kwargs) - set(self.input_names) - set(bound):
            return None
        full = {}
        for name in self.input_names:
            if name in kwargs:
                v = kwargs[name]
                if name in self.constants and (isinstance(v, torch.Tensor) or repr(v) != repr(self.constants[name])):
                    return None
                full[name] = v
            elif name in self.constants:
                full[name] = self.constants[name]
            elif name == "attention_mask" and isinstance(kwargs.get("input_ids"), torch.Tensor):
                full[name] = torch.ones_like(kwargs["input_ids"])
            else:
                return None
        sig = InputSignature.of({**full, **bound}, static_batch=not self.batch_inputs, static_seq=self.static_seq)
        return full if sig == self.signature else None


def batch_inputs(gm: torch.fx.GraphModule, batch_symbol) -> frozenset[str]:
    """The graph's inputs whose dim 0 is the dynamic batch (what padding extends)."""
    out = set()
    for n in gm.graph.nodes:
        v = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and isinstance(v.shape[0], torch.SymInt) \
                and batch_symbol is not None and v.shape[0].node.expr == batch_symbol:
            out.add(n.name)
    return frozenset(out)


def pad_rows(kwargs: dict, b: int, to: int, names) -> dict:
    """``kwargs`` with every tensor of ``names`` grown from ``b`` to ``to`` rows:
    integer ``labels`` with :data:`IGNORE_INDEX`, everything else with copies of its
    last row (real tokens and masks, so no row is fully masked and nothing turns NaN)."""
    out = dict(kwargs)
    extra = to - b
    for k in names:
        v = kwargs.get(k)
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != b or extra <= 0:
            continue
        if k.endswith("labels") and not v.is_floating_point():
            pad = torch.full((extra, *v.shape[1:]), IGNORE_INDEX, dtype=v.dtype, device=v.device)
        else:
            pad = v[-1:].expand(extra, *v.shape[1:])
        out[k] = torch.cat([v, pad], 0)
    return out


def trim_rows(out, b: int, padded: int):
    """Every tensor of ``out`` (a ``ModelOutput``, tuple or tensor) with ``padded``
    rows cut back to its first ``b``."""
    from torch.utils import _pytree as pytree

    def cut(v):
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == padded:
            return v[:b]
        return v

    if hasattr(out, "keys") and hasattr(out, "__setitem__"):      # ModelOutput: keep its class
        for k in list(out.keys()):
            out[k] = pytree.tree_map(cut, out[k])
        return out
    return pytree.tree_map(cut, out)


_CE = {"cross_entropy_loss": 4, "nll_loss": 4, "nll_loss_forward": 4, "nll_loss2d": 4, "nll_loss2d_forward": 4}


def _has_batch(v, batch_symbol) -> bool:
    return isinstance(v, torch.Tensor) and any(
        isinstance(d, torch.SymInt) and batch_symbol in d.node.expr.free_symbols for d in v.shape)


def _from_labels(node) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.op == "placeholder" and n.name.endswith("labels"):
            return True
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return False


def pad_blocker(gm: torch.fx.GraphModule, batch_symbol) -> str | None:
    """Why padded rows would change this graph's results, or None when padding is exact.

    Rows are independent up to the nodes that reduce over the batch (a tensor input
    carries the batch dim, the output does not). Padding is exact when each of them
    is a cross-entropy / NLL loss that ignores :data:`IGNORE_INDEX` with its target
    coming from ``labels`` (the padded rows' labels), or a count of labels that are
    not :data:`IGNORE_INDEX`. A train-mode ``batch_norm`` reduces over the batch while
    keeping it: its statistics would count the padded rows."""
    if batch_symbol is None:
        return None
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "call_function" and n.target is torch.ops.aten.batch_norm.default and len(n.args) > 5 \
                and n.args[5]:
            # a train-mode BatchNorm's statistics are the batch's: padded rows would count
            return f"node {n.name} (batch_norm in training) takes its statistics over the batch"
        if n.op != "call_function" or not isinstance(v, torch.Tensor) or _has_batch(v, batch_symbol):
            continue
        ins = [a for a in n.all_input_nodes if _has_batch(a.meta.get("val"), batch_symbol)]
        if not ins:
            continue
        op = getattr(n.target, "_opname", None) or getattr(n.target, "__name__", str(n.target))
        if op in _CE:
            i = _CE[op]
            ignore = n.args[i] if len(n.args) > i else n.kwargs.get("ignore_index", IGNORE_INDEX)
            if ignore == IGNORE_INDEX and len(n.args) > 1 and _from_labels(n.args[1]):
                continue
            return (f"node {n.name} ({op}) reduces over the batch with ignore_index={ignore} "
                    f"or a target not taken from labels")
        if op in ("sum", "count_nonzero") and isinstance(n.args[0], torch.fx.Node) and _counts_labels(n.args[0]):
            continue
        return f"node {n.name} ({op}) reduces over the batch dim"
    return None


def _counts_labels(node) -> bool:
    """``labels != -100`` (possibly converted): padded rows count 0."""
    while getattr(node.target, "_opname", "") in ("_to_copy", "to", "view", "reshape", "flatten"):
        node = node.args[0]
    op = getattr(node.target, "_opname", "")
    return op == "ne" and len(node.args) > 1 and node.args[1] == IGNORE_INDEX and _from_labels(node.args[0])
