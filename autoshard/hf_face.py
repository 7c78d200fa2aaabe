"""What a sharded module answers to the code that calls it as it calls the model.

A :class:`~autoshard.module.ShardedModule` takes the place of the model it came from
in someone else's code: a training loop calling ``model(tokens)`` positionally, a
client library that calls a ``PreTrainedModel``'s methods (TRL's ``SFTTrainer``:
``add_model_tags``, ``gradient_checkpointing_enable``; sentence-transformers:
``config``, ``base_model``). This module holds that face, mixed into the module by
:class:`ModelFace`, so each method maps to what it means for the sharded graph, or is
refused naming the method and what to do instead:

- ``add_model_tags`` / ``model_tags``: kept on the module, as transformers keeps them for
  the model card a client writes;
- ``gradient_checkpointing_enable()``: activation checkpointing of every repeated block
  of every graph (:mod:`autoshard.passes.remat`), and of the graphs captured later;
  ``gradient_checkpointing_disable()`` after that is refused (the blocks are outlined);
- ``base_model``: the module itself (a sharded model has no separate body);
- ``get_input_embeddings()`` / ``get_output_embeddings()``: the submodule holding the
  token embedding / output head weight (this rank's slice); ``set_input_embeddings``,
  ``resize_token_embeddings`` and ``tie_weights`` with other tensors are refused (the plan
  laid the weights out);
- ``enable_input_require_grads()`` (peft, gradient checkpointing on a frozen base): a
  no-op, the checkpointed blocks take the parameters as inputs, which require grads.

Positional calls bind to the model's own parameter names (:func:`bind_call`).

    >>> import torch
    >>> class M(torch.nn.Module):
    ...     def forward(self, tokens, mask=None, scale: float = 1.0):
    ...         return tokens
    >>> forward_names(M())
    ('tokens', 'mask', 'scale')
    >>> sorted(bind_call(('tokens', 'mask', 'scale'), (torch.zeros(2, 3),), {"scale": 2.0}))
    ['scale', 'tokens']
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from .ir.errors import ConfigError
from .ir.log import logger

__all__ = ["ModelFace", "forward_names", "bind_call", "embedding_names", "token_log_probs", "TokenLogProbs",
           "CLIENT_OPTIONS"]


def forward_names(model: torch.nn.Module) -> tuple[str, ...]:
    """The names ``model.forward`` binds positional arguments to, in order."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def bind_call(names: tuple[str, ...], args: tuple, kwargs: dict, where: str = "the sharded module") -> dict:
    """``args`` bound to ``names`` (the model's positional parameters) and merged with
    ``kwargs``: the keyword arguments a sharded graph is looked up by. ``None`` values
    bind too (and are dropped later, as absent)."""
    if len(args) > len(names):
        raise ConfigError(f"{where} takes {len(names)} positional argument(s) ({', '.join(names) or 'none'}), "
                          f"got {len(args)}; pass the others by keyword")
    twice = [n for n in names[:len(args)] if n in kwargs]
    if twice:
        raise ConfigError(f"{where} got {', '.join(repr(n) for n in twice)} both positionally and by keyword")
    return {**dict(zip(names, args)), **kwargs}


def _holder(module: torch.nn.Module, weight_names) -> torch.nn.Module | None:
    """The submodule of ``module`` that holds the first of ``weight_names`` as ``.weight``."""
    for name in weight_names:
        path, _, attr = name.rpartition(".")
        if attr == "weight":
            try:
                return module.get_submodule(path)
            except AttributeError:
                continue
    return None


class ModelFace:
    """The ``PreTrainedModel`` methods client libraries call, on a sharded module (see the
    module doc). Mixed into :class:`~autoshard.module.ShardedModule`."""

    supports_gradient_checkpointing = True
    _model_tags: list | None = None
    _call_names: tuple = ()
    _embedding_names: tuple = ()

    # -- calls
    @property
    def call_names(self) -> tuple[str, ...]:
        """The model's positional parameter names: what ``sharded(a, b)`` binds ``a``, ``b`` to."""
        return self._call_names

    def _bind(self, args: tuple, kwargs: dict):
        """``(the graph's keyword arguments, what turns the graph's output into the answer)``:
        positional arguments bound, a client's own call options (:data:`CLIENT_OPTIONS`) taken out."""
        kwargs = bind_call(self._call_names, args, kwargs) if args else kwargs
        if not any(k in kwargs for k in CLIENT_OPTIONS):
            return kwargs, _same
        kwargs = dict(kwargs)
        opts = {k: kwargs.pop(k) for k in CLIENT_OPTIONS if k in kwargs}
        if not opts.get("fused_lm_head"):
            if opts.get("shift_labels") is not None or opts.get("num_items_in_batch") is not None:
                raise ConfigError(f"a sharded module's call takes {', '.join(sorted(opts))} only with "
                                  f"fused_lm_head=True (TRL's per-token log-probabilities); its loss is the "
                                  f"global mean over the labelled tokens")
            return kwargs, _same
        labels = opts.get("shift_labels")
        shifted = labels is not None
        if labels is None:
            labels = kwargs.get("labels")
        if labels is None:
            raise ConfigError("fused_lm_head=True needs labels (or shift_labels): the log-probabilities are of "
                              "the next tokens")
        return kwargs, lambda out: token_log_probs(out, labels, shifted, opts.get("num_items_in_batch"))

    def __setattr__(self, name, value):
        # a client that patches ``model.forward`` (TRL's fused LM head) would run the model's
        # Python on this rank's slices: the module keeps its own forward, which answers the
        # client's options itself (:data:`CLIENT_OPTIONS`)
        if name == "forward" and callable(value) and "_graphs" in self.__dict__:
            logger.info("a client replaced forward (%s): the sharded module keeps its own, which answers "
                        "fused_lm_head=True from its gathered logits", getattr(value, "__qualname__", value))
            return
        super().__setattr__(name, value)

    # -- tags (TRL's trainers tag the model they train)
    @property
    def model_tags(self) -> list | None:
        """The tags added with :meth:`add_model_tags` (None before any)."""
        return self._model_tags

    def add_model_tags(self, tags) -> None:
        """Add ``tags`` (a string or a list) to :attr:`model_tags`, as transformers'
        ``PreTrainedModel.add_model_tags`` does."""
        tags = [tags] if isinstance(tags, str) else list(tags)
        self._model_tags = list(self._model_tags or [])
        self._model_tags += [t for t in tags if t not in self._model_tags]

    # -- activation checkpointing
    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether the repeated blocks recompute their activations in backward."""
        r = getattr(self, "_recipe", None)
        return bool(getattr(self, "_remat_on", False) or (r is not None and r.activation_checkpointing))

    is_activation_checkpointing = is_gradient_checkpointing

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs) -> None:
        """:meth:`activation_checkpointing_enable` under its older name."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Activation checkpointing, as ``shard(..., activation_checkpointing=True)``: every
        repeated block of each graph (and of every graph captured later) recomputes its
        activations in backward (:mod:`autoshard.passes.remat`; non-reentrant, whatever
        ``use_reentrant`` says: a graph block has no reentrant form). ``every_n_layers`` other
        than 1 and ``offload=True`` are refused: every block is checkpointed, on the device."""
        from .passes.remat import checkpoint_blocks

        if every_n_layers != 1 or offload:
            raise ConfigError(f"activation checkpointing with every_n_layers={every_n_layers}, offload={offload}: "
                              f"a sharded module checkpoints every repeated block, its saved inputs on the device; "
                              f"valid choices: every_n_layers=1, offload=False")
        if self.is_gradient_checkpointing:
            return
        if self._compiler.on or self._eager.on or self._blocks_split:
            raise ConfigError("gradient_checkpointing_enable() after compile(), prefetch_weights(), async_tp() or "
                              "split_blocks(): enable it first, or shard(..., activation_checkpointing=True)")
        for g in self._graphs:
            checkpoint_blocks(g.gm)
        if self._recipe is not None:
            self._recipe = dataclasses.replace(self._recipe, activation_checkpointing=True)
        self._remat_on = True

    def activation_checkpointing_disable(self) -> None:
        """:meth:`gradient_checkpointing_disable`."""
        self.gradient_checkpointing_disable()

    def gradient_checkpointing_disable(self) -> None:
        """Refused once enabled: the blocks are outlined into checkpointed submodules of
        every graph; a no-op when checkpointing is off."""
        if self.is_gradient_checkpointing:
            raise ConfigError("gradient_checkpointing_disable(): this module's graphs run their blocks "
                              "checkpointed (outlined at gradient_checkpointing_enable() or shard("
                              "activation_checkpointing=True)); shard the model again without it")

    def enable_input_require_grads(self) -> None:
        """A no-op: transformers makes the embeddings' output require grad so that reentrant
        checkpointing of a frozen base back-propagates; the blocks here are checkpointed
        non-reentrantly."""

    # -- parts of the model
    @property
    def base_model(self) -> torch.nn.Module:
        """The module itself: a sharded model is one graph, with no separate base model."""
        return self

    def get_input_embeddings(self) -> torch.nn.Module:
        """The submodule holding the model's token embedding weight (this rank's slice, as
        the plan lays it out: ``.weight`` only, the graph runs it, not this submodule)."""
        held = _holder(self, self._embedding_names[:1])
        if held is None:
            raise ConfigError("get_input_embeddings(): the model sharded had no token embedding (an nn.Embedding, "
                              "or what its own get_input_embeddings() returned)")
        return held

    def get_output_embeddings(self) -> torch.nn.Module | None:
        """The submodule holding the model's output head weight (this rank's slice), or None."""
        return _holder(self, self._embedding_names[1:])

    def set_input_embeddings(self, value) -> None:
        raise ConfigError("set_input_embeddings(): the plan laid out this module's embedding weight and every "
                          "graph reads it; set it on the model before autoshard.shard()")

    def resize_token_embeddings(self, *args, **kwargs):
        raise ConfigError("resize_token_embeddings(): the plan split the vocabulary of the embedding and the "
                          "head; resize the model before autoshard.shard()")

    def tie_weights(self, *args, **kwargs) -> None:
        """A no-op: tied weights are one parameter of the plan already (its aliases)."""


# call options a client adds to a model's call (TRL's ``add_fused_lm_head`` patches
# ``forward`` to take them); the module answers them from its graph's gathered logits
CLIENT_OPTIONS = ("fused_lm_head", "shift_labels", "num_items_in_batch")


def _same(out):
    return out


@dataclass
class TokenLogProbs(ModelOutput):
    """What TRL's fused LM head returns (``FusedCausalLMOutput``): per-token log-probabilities
    of the next tokens, the mask of labelled ones and their mean negative as ``loss``."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def token_log_probs(out, labels: torch.Tensor, shifted: bool = False, num_items=None) -> TokenLogProbs:
    """TRL's ``fused_lm_head=True`` answer from a causal LM's full logits: the log-probability
    of each next token (``labels`` shifted by one unless ``shifted``), zero where the label is
    ``-100``, with its entropy, top-1 hit, and ``loss = -sum / (labelled tokens or
    num_items)`` (the model's own mean loss).

    >>> logits = torch.tensor([[[0.0, 0.0], [0.0, 5.0], [1.0, 1.0]]])
    >>> r = token_log_probs({"logits": logits}, torch.tensor([[-100, 1, -100]]))
    >>> r.label_mask.tolist(), round(float(r.loss), 4)
    ([[True, False]], 0.6931)"""
    logits = out["logits"]
    if not shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    logp = torch.log_softmax(logits.float(), dim=-1)
    mask = labels != -100
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0)
    entropy = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0)
    top1 = (logits.argmax(-1) == labels) & mask
    denom = mask.sum().clamp(min=1) if num_items is None else num_items
    return TokenLogProbs(loss=-picked.sum() / denom, log_probs=picked, entropy=entropy, is_top1=top1,
                         label_mask=mask, aux_loss=out.get("aux_loss") if hasattr(out, "get") else None)


def embedding_names(model: torch.nn.Module) -> tuple:
    """``(input embedding weight, output head weight)`` names of ``model``: what its own
    ``get_input_embeddings()`` / ``get_output_embeddings()`` return (a transformers model),
    else its first ``nn.Embedding`` (a plain module); ``()`` / one name where it has none."""
    paths: dict = {}
    for n, m in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), n)
    out = []
    for get in ("get_input_embeddings", "get_output_embeddings"):
        try:
            mod = getattr(model, get)() if callable(getattr(model, get, None)) else None
        except (NotImplementedError, AttributeError):
            mod = None
        if mod is None and get == "get_input_embeddings":
            mod = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
        if not isinstance(getattr(mod, "weight", None), torch.Tensor) or id(mod) not in paths:
            break
        out.append(f"{paths[id(mod)]}.weight".lstrip("."))
    return tuple(out)
