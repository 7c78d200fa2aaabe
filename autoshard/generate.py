"""``generate()`` on a sharded causal LM, with a static KV cache sharded as the plan
shards attention.

The model is captured twice more, on meta, as a *step*: its forward with a static
cache of ``max_len`` positions passed as graph inputs (``cache_keys[i]``,
``cache_values[i]``: ``[batch, kv_heads, max_len, head_dim]``) that the step writes in
place with ``index_copy_`` at ``cache_position``, returning the last position's
logits. One graph takes the prompt (prefill: any prompt length), one takes a token
(decode: length 1); both are planned with the module's own policy and rewritten for
the rank like any graph (:mod:`autoshard.recapture`), so their parameters are the
module's own slices. The cache inputs are *state inputs*
(:func:`autoshard.passes.propagate.state_inputs`): the propagate pass gives each the
layout of what its first write brings -- heads over the tensor-parallel axis in 1d,
batch rows and heads over the mesh axes in 2d / 2.5d / 3d -- and each rank allocates
only its block of it (:attr:`~autoshard.plan.ShardingPlan.state_bytes_per_rank`). Each graph is captured once per
``max_len`` (rounded up to a multiple of 64) and reused for every token and every
later call.

Hugging Face's own generation loop drives it: :class:`ShardedLM` is a
``GenerationMixin`` whose forward runs the step graphs, so greedy search, sampling,
logits processors, ``eos_token_id`` stopping per sequence and the output formats are
transformers' own. Sampling draws from the default generator after the logits are
gathered (identical bytes on every rank), so ranks seeded alike draw the same tokens;
:meth:`autoshard.module.ShardedModule.generate` checks the generators agree first.

Example (under ``torchrun --nproc-per-node 2``)::

    sharded = autoshard.shard(model, mode="1d")
    out = sharded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.export import Dim

from .builder import build_meta
from .capture_share import capture_shared
from .errors import ConfigError
from .groups import plan_groups
from .hf_fill import fill_buffers, set_param
from .log import logger
from .passes.capture import Captured
from .passes.pipeline import plan_captured, prepare
from .passes.rewrite import rewrite

__all__ = ["Generator", "ShardedCache", "sharded_lm", "step_class", "cache_shapes", "capture_step", "step_inputs",
           "drop_guards", "LEN_QUANTUM"]

LEN_QUANTUM = 64        # cache lengths are rounded up to a multiple of this: one graph pair serves many calls


def _slot_class():
    from transformers.cache_utils import StaticLayer

    class _Slot(StaticLayer):
        """One layer's static cache as transformers' attention sees it: ``update``
        writes the new keys and values at ``pos`` in place and returns the whole cache."""

        def __init__(self, keys, values, pos):
            super().__init__(max_cache_len=keys.shape[2])
            self.keys, self.values, self.pos = keys, values, pos
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            self.keys.index_copy_(2, self.pos, key_states)
            self.values.index_copy_(2, self.pos, value_states)
            return self.keys, self.values

        def get_query_offset(self):
            return self.pos[0]

        def get_seq_length(self):
            return self.pos[0]

    return _Slot


def _slot_cache(keys, values, pos):
    from transformers.cache_utils import Cache

    slot = _slot_class()
    return Cache(layers=[slot(k, v, pos) for k, v in zip(keys, values)])


def step_class(cls: type) -> type:
    """``cls`` whose forward is one cached step: ``(input_ids [b, s], attention_mask
    [b, max_len], position_ids [b, s], cache_position [s], cache_keys, cache_values)
    -> logits [b, 1, vocab]`` of the last position, the caches written in place.
    Same parameter and buffer names as ``cls`` (it *is* ``cls`` but for forward)."""
    def forward(self, input_ids, attention_mask, position_ids, cache_position, cache_keys, cache_values):
        out = cls.forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=_slot_cache(cache_keys, cache_values, cache_position), use_cache=True,
                          logits_to_keep=1)
        return out.logits

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})


def cache_shapes(config, batch: int, max_len: int) -> tuple[int, tuple[int, ...]]:
    """(layers, global shape of one layer's keys) of the static cache."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(c, "is_encoder_decoder", False):
        raise ConfigError("generate() on a sharded encoder-decoder is not supported yet: its cross-attention cache "
                          "is computed once from the encoder output, which the step graphs do not take; "
                          "decoder-only causal LMs are")
    heads = int(getattr(c, "num_attention_heads"))
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    return int(c.num_hidden_layers), (batch, kv, max_len, head_dim)


def step_inputs(config, *, prefill: bool, max_len: int, device="meta", dtype=torch.float32) -> dict:
    """Example inputs of a step graph: a batch of 3, a prompt of 5 (prefill) or one
    token (decode), a cache of ``max_len`` positions (what :func:`capture_step` takes)."""
    batch, seq = 3, (5 if prefill else 1)
    if max_len in (batch, seq):
        raise ConfigError(f"cache length {max_len} is too small")
    layers, shape = cache_shapes(config, batch, max_len)
    z = lambda *s, dt=torch.long: torch.zeros(*s, dtype=dt, device=device)      # noqa: E731
    return {"input_ids": z(batch, seq), "attention_mask": z(batch, max_len), "position_ids": z(batch, seq),
            "cache_position": torch.arange(seq, device=device),
            "cache_keys": [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)],
            "cache_values": [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]}


def capture_step(model: nn.Module, *, example_inputs: dict) -> Captured:
    """Export ``model`` (a :func:`step_class` instance, weights on meta or real) for
    :func:`step_inputs`: the prefill step (dynamic batch and prompt length) or the
    decode step (dynamic batch, one token), with a static cache. The graph keeps
    export's input guards (:func:`drop_guards` removes them)."""
    kw = example_inputs
    prefill = kw["input_ids"].shape[1] > 1
    max_len = kw["attention_mask"].shape[1]
    b = Dim("batch", min=1, max=1 << 16)
    s = Dim("seq", min=2, max=max_len)
    n = len(kw["cache_keys"])
    dyn = {"input_ids": {0: b, 1: s} if prefill else {0: b}, "attention_mask": {0: b},
           "position_ids": {0: b, 1: s} if prefill else {0: b}, "cache_position": {0: s} if prefill else None,
           "cache_keys": [{0: b}] * n, "cache_values": [{0: b}] * n}
    ep = torch.export.export(model, (), kw, dynamic_shapes=dyn, strict=False)
    gm = ep.module()
    val = next(x for x in gm.graph.nodes if x.name == "input_ids").meta["val"]
    bsym = val.shape[0].node.expr if isinstance(val.shape[0], torch.SymInt) else None
    ssym = val.shape[1].node.expr if isinstance(val.shape[1], torch.SymInt) else None
    return Captured(program=ep, module=gm, model_name=type(model).__name__, input_names=tuple(kw), constants={},
                    batch_symbol=bsym, seq_symbol=ssym, example_inputs=kw, training=False, config=model.config,
                    seq_range=(2 if prefill else 1, max_len))


def drop_guards(gm) -> None:
    """Remove export's input guards from ``gm``: they check the global cache shape, and
    each rank passes its block of the cache."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


class Generator:
    """The step graphs of one :class:`~autoshard.module.ShardedModule`, keyed by
    ``(prefill, max_len)``; each is captured, planned and rewritten once."""

    def __init__(self, module):
        self.module = module
        self.graphs: dict = {}          # (prefill, max_len) -> (graph module, plan)
        self.captures = 0               # how many step graphs were captured (tests: never grows per token)

    def graph(self, *, prefill: bool, max_len: int, batch: int):
        key = (prefill, max_len)
        if key not in self.graphs:
            self.graphs[key] = self._capture(prefill, max_len, batch)
        return self.graphs[key]

    def _capture(self, prefill: bool, max_len: int, batch: int):
        m = self.module
        r = m._recipe
        if r is None:
            raise ConfigError("generate() needs a module sharded from a Hugging Face model (its class and config "
                              "rebuild the model for the step graphs)")
        t0 = time.perf_counter()
        built = build_meta(r.config, model_class=step_class(r.model_class), dtype=m.dtype)
        built.model.eval()
        ex = step_inputs(r.config, prefill=prefill, max_len=max_len, dtype=m.dtype)
        cap = capture_shared(built.model, example_inputs=ex, capture_fn=capture_step)   # collective
        drop_guards(cap.module)
        cap = prepare(cap, r.policy)
        p = plan_captured(cap, r.policy, batch_size=batch, seq_len=5 if prefill else 1,
                          gather_outputs=True, dropout=r.dropout)
        held = {n: pp for pp in m.plan.params for n in (pp.name, *pp.aliases)}
        for pp in p.params:
            mine = next((held[n] for n in (pp.name, *pp.aliases) if n in held), None)
            if mine is None or mine.spec != pp.spec or tuple(mine.global_shape) != tuple(pp.global_shape):
                raise ConfigError(f"the {'prefill' if prefill else 'decode'} step splits parameter {pp.name!r} as "
                                  f"{pp.spec}, the module holds it as {mine.spec if mine else 'nothing'}: this "
                                  f"model cannot generate with this module's layout")
        groups = plan_groups(p, m.rank)
        m.groups.update(groups)
        gm = rewrite(cap.module, p, rank=m.rank, groups=groups)
        own = m.graph_module()
        for pp in p.params:
            name = next(n for n in (pp.name, *pp.aliases) if n in held)
            set_param(gm, (pp.name, *pp.aliases), own.get_parameter(held[name].name))
        fill_buffers(gm, built, device=m.device)
        self.captures += 1
        logger.info("captured the %s step (cache %d) in %.1f s", "prefill" if prefill else "decode", max_len,
                    time.perf_counter() - t0)
        return gm, p

    def cache(self, plan, batch: int, max_len: int, device, dtype) -> tuple[list, list]:
        """This rank's blocks of the cache the plan's state inputs describe, zeroed."""
        keys, values = [], []
        for n in plan.nodes:
            if n.kind != "state":
                continue
            g = (batch,) + tuple(n.global_shape[1:-2]) + (max_len, n.global_shape[-1])
            t = torch.zeros(n.out_spec.local_shape(g, plan.mesh), device=device, dtype=dtype)
            (keys if n.name.startswith("cache_keys") else values).append(t)
        return keys, values


class ShardedCache:
    """The ``past_key_values`` transformers' loop carries between steps: this rank's
    cache blocks and how many positions are filled (``Cache`` protocol, enough of it
    for ``generate``)."""

    is_compileable = False

    def __init__(self, keys, values, max_len: int):
        self.keys, self.values, self.max_len, self.seen = keys, values, max_len, 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_len

    def __len__(self) -> int:
        return len(self.keys)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch, as transformers derives them from the mask."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


def _cache_class():
    from transformers.cache_utils import Cache

    class _Cache(ShardedCache, Cache):
        """:class:`ShardedCache` that transformers recognises as a ``Cache``."""

        def __init__(self, keys, values, max_len: int):
            Cache.__init__(self, layers=[])
            ShardedCache.__init__(self, keys, values, max_len)

    return _Cache


def sharded_lm(module, *, max_len: int, batch: int):
    """A transformers ``GenerationMixin`` model whose forward runs ``module``'s step
    graphs (:class:`Generator`) on a fresh cache of ``max_len`` positions for ``batch``
    sequences; returns ``(lm, cache)``: pass the cache as ``past_key_values``."""
    from transformers import GenerationMixin
    from transformers.modeling_outputs import CausalLMOutputWithPast

    gen = module._generator
    decode_gm, decode_plan = gen.graph(prefill=False, max_len=max_len, batch=batch)
    keys, values = gen.cache(decode_plan, batch, max_len, module.device, module.dtype)
    cache = _cache_class()(keys, values, max_len)

    class ShardedLM(GenerationMixin, nn.Module):
        main_input_name = "input_ids"
        _is_stateful = False
        _supports_cache_class = True

        def __init__(self):
            nn.Module.__init__(self)
            self.config = module.config
            self.generation_config = module.generation_config

        @property
        def device(self):
            return module.device

        @property
        def dtype(self):
            return module.dtype

        @classmethod
        def can_generate(cls) -> bool:
            return True

        @classmethod
        def is_remote_code(cls) -> bool:
            return False

        def get_experts_implementation(self) -> dict:       # the step graphs fixed the experts' kernels
            return {}

        def set_experts_implementation(self, impl) -> None:
            pass

        def get_compiled_call(self, compile_config):        # the step graphs are the compiled form
            return self.__call__

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=None, return_dict=None, logits_to_keep=None, **kwargs):
            c = past_key_values if past_key_values is not None else cache
            b, s = input_ids.shape
            start = c.seen
            if start + s > c.max_len:
                raise ConfigError(f"generation reached {start + s} positions, over the cache's {c.max_len}")
            mask = torch.zeros(b, c.max_len, dtype=torch.long, device=input_ids.device)
            if attention_mask is None:
                mask[:, :start + s] = 1
            else:
                mask[:, :start + s] = attention_mask[:, :start + s]
            if position_ids is None:
                position_ids = _positions(mask[:, :start + s])[:, start:]
            gm, _ = gen.graph(prefill=s > 1, max_len=c.max_len, batch=b)
            logits = gm(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                        cache_position=torch.arange(start, start + s, device=input_ids.device),
                        cache_keys=c.keys, cache_values=c.values)
            c.seen = start + s
            return CausalLMOutputWithPast(logits=logits, past_key_values=c)

    return ShardedLM(), cache
