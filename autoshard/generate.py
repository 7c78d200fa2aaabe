"""``generate()`` on a sharded model, with a static KV cache sharded as the plan
shards attention.

The model is captured again, on meta, as *steps*: its forward with a static cache of
``max_len`` positions passed as graph inputs (``cache_keys[i]``, ``cache_values[i]``:
``[batch, kv_heads, max_len, head_dim]``, shaped as each layer writes them:
:func:`cache_shapes`) that the step writes in place with ``index_copy_`` at
``cache_position``, returning the last position's logits. One graph takes the prompt
(prefill: any prompt length), one a token (decode); an encoder-decoder adds its
encoder as a graph of its own, run once, and steps its decoder (cross-attention
recomputed from the encoder output at each step). Each is planned with the module's
policy and its parameter layouts pinned, rewritten for the rank and bound to the
module's own slices (:func:`autoshard.launch.recapture.rewrite_bound`). The cache inputs are
*state inputs* (:func:`autoshard.passes.propagate.state_inputs`): the propagate pass
gives each the layout of what its first write brings -- heads over the
tensor-parallel axis in 1d, batch rows and heads over the mesh axes in 2d / 2.5d /
3d -- and each rank allocates only its block
(:attr:`~autoshard.ir.plan.ShardingPlan.state_bytes_per_rank`). Each graph is captured
once per ``max_len`` (rounded up to a multiple of 64; rank 0 exports, the others
load, and the disk cache keeps it) and reused for every token and every later call.

Hugging Face's own generation loop drives them: :func:`sharded_lm` makes a
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

from .io.builder import build_meta
from .ir.errors import ConfigError
from .io.hf_fill import meta_tensors
from .ir.log import logger
from .passes.capture import Captured, input_symbols, log_mel_shape, unlift
from .passes.experts import mode_layout
from .ir.plan import ShardingPlan
from .launch.pipeline import PIPELINE, layout_state
from .launch.recapture import rewrite_bound

__all__ = ["Generator", "sharded_lm", "step_class", "encoder_class", "is_encoder_decoder",
           "cache_shapes", "capture_step", "step_inputs", "drop_guards", "plan_graph", "plan_step", "LEN_QUANTUM"]

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

    class _Pass(StaticLayer):
        """A cross-attention layer that keeps nothing: the step computes the keys and
        values of the encoder output again at every token (they are not a graph input)."""

        def __init__(self):
            super().__init__(max_cache_len=0)
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            return key_states, value_states

        def get_seq_length(self):
            return 0

    return _Slot, _Pass


def _slot_cache(keys, values, pos):
    from transformers.cache_utils import Cache

    slot, _ = _slot_class()
    return Cache(layers=[slot(k, v, pos) for k, v in zip(keys, values)])


def _cross_cache(layers: int):
    from transformers.cache_utils import Cache

    _, passing = _slot_class()
    return Cache(layers=[passing() for _ in range(layers)])


def is_encoder_decoder(config) -> bool:
    return bool(getattr(config, "is_encoder_decoder", False))


def step_class(cls: type, *, encoder_decoder: bool = False) -> type:
    """``cls`` whose forward is one cached step: ``(input_ids [b, s], attention_mask
    [b, max_len], position_ids [b, s], cache_position [s], cache_keys, cache_values)
    -> logits [b, 1, vocab]`` of the last position, the caches written in place.
    Same parameter and buffer names as ``cls`` (it *is* ``cls`` but for forward).

    An encoder-decoder's step is its decoder's: ``input_ids`` are the decoder's, its
    ``attention_mask`` the decoder's over the cache, and it takes the encoder's output
    and mask (``encoder_hidden_states [b, t, h]``, ``encoder_attention_mask [b, t]``)
    in place of ``position_ids``; its cross-attention keys and values are computed
    from them at each step."""
    import inspect

    # a mixture of experts' router logits feed its auxiliary loss, which a step does not compute
    extra = {"output_router_logits": False} if "output_router_logits" in inspect.signature(cls.forward).parameters \
        else {}

    def forward(self, input_ids, attention_mask, position_ids, cache_position, cache_keys, cache_values):
        out = cls.forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=_slot_cache(cache_keys, cache_values, cache_position), use_cache=True,
                          logits_to_keep=1, **extra)
        return out.logits[:, -1:]

    def forward_seq2seq(self, input_ids, attention_mask, cache_position, cache_keys, cache_values,
                        encoder_hidden_states, encoder_attention_mask):
        from transformers.cache_utils import EncoderDecoderCache

        cache = EncoderDecoderCache(_slot_cache(cache_keys, cache_values, cache_position),
                                    _cross_cache(len(cache_keys)))
        out = cls.forward(self, attention_mask=encoder_attention_mask, decoder_input_ids=input_ids,
                          decoder_attention_mask=attention_mask, encoder_outputs=(encoder_hidden_states,),
                          past_key_values=cache, use_cache=True, **extra)
        return out.logits[:, -1:]

    return type(cls.__name__, (cls,), {"forward": forward_seq2seq if encoder_decoder else forward,
                                       "__module__": cls.__module__, "_autoshard_base": cls})


def encoder_class(cls: type) -> type:
    """``cls`` whose forward runs its encoder alone: ``(input_ids, attention_mask) ->
    last_hidden_state`` (an encoder-decoder's first generation step), or
    ``(input_features) -> last_hidden_state`` for a model led by log-mel frames (Whisper:
    ``main_input_name``)."""
    def forward(self, input_ids, attention_mask):
        return self.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def forward_features(self, input_features):
        return self.get_encoder()(input_features=input_features).last_hidden_state

    return type(cls.__name__, (cls,), {"forward": forward_features if _main_input(cls) == "input_features"
                                       else forward, "__module__": cls.__module__})


def _main_input(model_class: type) -> str:
    """The input transformers' ``generate`` leads with (``main_input_name``)."""
    return getattr(model_class, "main_input_name", "input_ids")


def encoder_example(config, model_class: type) -> dict:
    """Example inputs of :func:`encoder_class`'s graph (on meta): token ids and their
    mask, or log-mel frames (as many as the encoder's positions require)."""
    if _main_input(model_class) == "input_features":
        return {"input_features": torch.zeros(2, *log_mel_shape(config), device="meta")}
    return {"input_ids": torch.zeros(2, 8, dtype=torch.long, device="meta"),
            "attention_mask": torch.zeros(2, 8, dtype=torch.long, device="meta")}


def cache_shapes(model: nn.Module) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per decoder layer, the ``[kv_heads, head_dim]`` of the keys and of the values its
    attention caches: read from one forward of ``model`` (on meta: no compute) whose
    cache records what each layer writes, so no config attribute names are guessed
    (Falcon's ``num_kv_heads``, T5's ``d_kv``, per-layer sizes all come out as the model
    computes them)."""
    from transformers.cache_utils import Cache, EncoderDecoderCache, StaticLayer

    seen: dict[int, tuple] = {}

    class Record(StaticLayer):
        def __init__(self, i):
            super().__init__(max_cache_len=0)
            self.i, self.is_initialized = i, True

        def update(self, key_states, value_states, *args, **kwargs):
            seen[self.i] = (tuple(key_states.shape[1:2]) + tuple(key_states.shape[3:]),
                            tuple(value_states.shape[1:2]) + tuple(value_states.shape[3:]))
            # one position already cached: the mask is not square, so transformers does not look
            # into it to skip it (a data-dependent check that meta tensors cannot answer)
            return (torch.cat([key_states[:, :, :1], key_states], 2),
                    torch.cat([value_states[:, :, :1], value_states], 2))

        def get_seq_length(self):
            return 1

        def get_query_offset(self):
            return 1

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return query_length + 1, 0

    cls = getattr(type(model), "_autoshard_base", type(model))
    device = next(model.parameters()).device
    ids = torch.ones(2, 3, dtype=torch.long, device=device)
    rec = Cache(layers=[Record(i) for i in range(1024)])
    kw = dict(use_cache=True)
    if is_encoder_decoder(model.config):
        kw.update(input_ids=ids, decoder_input_ids=ids, past_key_values=EncoderDecoderCache(rec, _cross_cache(1024)))
    else:
        kw.update(input_ids=ids, past_key_values=rec)
    try:
        with torch.no_grad():
            cls.forward(model, **kw)
    except Exception as e:  # noqa: BLE001 - a forward meta tensors cannot run (MoE routing): the config's sizes
        return _shapes_from_config(model.config, cls.__name__, e)
    if not seen or sorted(seen) != list(range(len(seen))):
        raise ConfigError(f"generate(): {cls.__name__}'s attention wrote no key/value cache for layers "
                          f"{sorted(seen) or 'any'} in a forward with use_cache=True; it cannot generate with a "
                          f"static cache")
    return [seen[i] for i in range(len(seen))]


def _shapes_from_config(config, name: str, why: Exception) -> list:
    """:func:`cache_shapes` from the config's usual names, where the model's forward cannot
    run on meta (a mixture of experts routes on values)."""
    c = config
    if not is_encoder_decoder(config) and hasattr(config, "get_text_config"):
        c = config.get_text_config(decoder=True)

    def first(*names):
        return next((int(v) for v in (getattr(c, n, None) for n in names) if v), None)

    heads = first("decoder_attention_heads", "num_heads", "num_attention_heads")
    layers = first("decoder_layers", "num_decoder_layers", "num_hidden_layers")
    hidden = first("d_model", "hidden_size")
    if heads is None or layers is None or hidden is None:
        raise ConfigError(f"generate(): cannot tell {name}'s cache shapes: its forward does not run on the meta "
                          f"device ({type(why).__name__}: {str(why).splitlines()[0][:200]}) and its config names no "
                          f"num_hidden_layers / num_attention_heads / hidden_size") from why
    kv = first("num_key_value_heads") or heads
    head_dim = first("head_dim", "d_kv") or hidden // heads
    return [((kv, head_dim), (kv, head_dim))] * layers


def step_inputs(model: nn.Module, *, prefill: bool, max_len: int, device="meta", dtype=torch.float32) -> dict:
    """Example inputs of ``model``'s step graph: a batch of 3, a prompt of 5 (prefill)
    or one token (decode), a cache of ``max_len`` positions shaped as each layer writes
    it (:func:`cache_shapes`): what :func:`capture_step` takes."""
    batch, seq = 3, (5 if prefill else 1)
    if max_len in (batch, seq):
        raise ConfigError(f"cache length {max_len} is too small")
    config = model.config
    shapes = cache_shapes(model)
    z = lambda *s, dt=torch.long: torch.zeros(*s, dtype=dt, device=device)      # noqa: E731
    out = {"input_ids": z(batch, seq), "attention_mask": z(batch, max_len), "position_ids": z(batch, seq),
           "cache_position": torch.arange(seq, device=device),
           "cache_keys": [torch.zeros(batch, k[0], max_len, *k[1:], device=device, dtype=dtype) for k, _ in shapes],
           "cache_values": [torch.zeros(batch, v[0], max_len, *v[1:], device=device, dtype=dtype) for _, v in shapes]}
    if is_encoder_decoder(config):
        t = 7 if max_len != 7 else 6
        hidden = getattr(config, "d_model", None) or config.hidden_size
        del out["position_ids"]
        out["encoder_hidden_states"] = torch.zeros(batch, t, hidden, device=device, dtype=dtype)
        out["encoder_attention_mask"] = z(batch, t)
    return out


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
    if "encoder_hidden_states" in kw:           # an encoder-decoder's step: any source length
        t = Dim("source", min=2, max=1 << 16)
        del dyn["position_ids"]
        dyn.update(encoder_hidden_states={0: b, 1: t}, encoder_attention_mask={0: b, 1: t})
    ep = torch.export.export(model, (), kw, dynamic_shapes=dyn, strict=False)
    gm, guards = unlift(ep)
    bsym, ssym = input_symbols(gm)
    return Captured(program=ep, module=gm, model_name=type(model).__name__, input_names=tuple(kw), constants={},
                    guards=guards,
                    batch_symbol=bsym, seq_symbol=ssym, example_inputs=kw, training=False, config=model.config,
                    seq_range=(2 if prefill else 1, max_len))


def drop_guards(gm) -> None:
    """Remove export's input guards from ``gm``: they check the global cache shape, and
    each rank passes its block of the cache."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def plan_graph(built, what: str, example, capture_fn, policy, held_plan, *, batch: int, seq: int,
               dropout: str = "sharded", capture_with: str = "shared"):
    """Capture ``built.model`` (a step or encoder class on meta) for ``example(model)`` and
    plan it under ``policy`` with the layouts of ``held_plan`` (the module's plan) pinned
    and its vocabulary padded alike, through the launch pipeline's capture (``capture_with``:
    :class:`~autoshard.launch.pipeline.LaunchState`'s), prepare and plan stages;
    returns ``(prepared capture, plan)``. Refuses, by name,
    a graph that holds tensors its forward computes (a meta capture leaves them without
    values) or that would split a parameter otherwise than ``held_plan``."""
    state = PIPELINE.run(layout_state(policy, dropout=dropout, gather_outputs=True, model=built.model,
                                      example_inputs=example(built.model), capture_with=capture_with,
                                      capture_fn=capture_fn), "capture")
    cap = state.captured
    drop_guards(cap.module)
    filled = {n for n, _ in cap.module.named_parameters(remove_duplicate=False)} | set(built.buffers)
    made = [n for n in meta_tensors(cap.module) if n not in filled]     # constants export lifted out of the forward
    name = getattr(type(built.model), "_autoshard_base", type(built.model)).__name__
    if made:        # tensors the forward creates (export lifts them): on meta they have no values
        raise ConfigError(f"generate(): the {what} of {name} holds tensors its forward computes "
                          f"({', '.join(made[:4])}{', ...' if len(made) > 4 else ''}), which a capture on the meta "
                          f"device leaves without values; this model cannot generate sharded yet")
    padded = next((pp for pp in held_plan.params if pp.dense_shape), None)
    vocab = None
    if padded is not None:      # pad the step's vocabulary as the module's was
        vocab = next(d for d, g in zip(padded.dense_shape, padded.global_shape) if d != g)
    held = held_plan.params_by_name()
    mine = {n for n, _ in cap.module.named_parameters(remove_duplicate=False)}
    pinned = {n: mode_layout(pp.spec, held_plan.mesh, policy.ep) for n, pp in held.items() if n in mine}
    state = PIPELINE.run(state.but(vocab=vocab, pinned=pinned, batch_size=batch, seq_len=seq), "prepare", "plan")
    cap, p = state.prepared, state.plan
    used = {n.target for n in cap.module.graph.nodes if n.op == "get_attr" and n.users}
    for pp in p.params:
        have = next((held[n] for n in (pp.name, *pp.aliases) if n in held), None)
        if not used & {pp.name, *pp.aliases}:       # a step reads the decoder alone: the encoder's stay unread
            continue
        if have is None or have.spec != pp.spec or tuple(have.global_shape) != tuple(pp.global_shape):
            raise ConfigError(f"the {what} splits parameter {pp.name!r} as {pp.spec}, the module holds it as "
                              f"{have.spec if have else 'nothing'}: this model cannot generate with this "
                              f"module's layout")
    return cap, p


def plan_step(model: nn.Module, policy, held_plan, *, step: str = "decode", max_len: int = 128,
              batch: int = 8) -> ShardingPlan:
    """The plan of ``model``'s generation step (``"decode"``: one token per sequence;
    ``"prefill"``: the prompt) for a cache of ``max_len`` positions and ``batch``
    sequences, laid out as ``held_plan`` (the model's own plan under ``policy``) lays the
    parameters: what :meth:`~autoshard.module.ShardedModule.generate` would run, planned
    without processes (:func:`autoshard.plan` with ``step=``)."""
    if step not in ("decode", "prefill"):
        raise ConfigError(f"step={step!r}: the generation steps are 'decode' and 'prefill'")
    prefill = step == "prefill"
    built = build_meta(model.config, model_class=step_class(type(model),
                                                            encoder_decoder=is_encoder_decoder(model.config)))
    built.model.eval()
    _, p = plan_graph(built, f"{step} step (cache {max_len})",
                      lambda m: step_inputs(m, prefill=prefill, max_len=max_len), capture_step, policy, held_plan,
                      batch=batch, seq=5 if prefill else 1, capture_with="cached")
    return p


class Generator:
    """The step graphs of one :class:`~autoshard.module.ShardedModule`, keyed by
    ``(prefill, max_len)``; each is captured, planned and rewritten once."""

    def __init__(self, module):
        self.module = module
        self.graphs: dict = {}          # (prefill, max_len) -> (graph module, plan)
        self.captures = 0               # how many step graphs were captured (tests: never grows per token)

    def graph(self, *, prefill: bool, max_len: int, batch: int):
        """The ``(graph module, plan)`` of the prefill or decode step for a cache of ``max_len``."""
        key = (prefill, max_len)
        if key not in self.graphs:
            r = self._recipe()
            ed = is_encoder_decoder(r.config)
            self.graphs[key] = self._capture(
                f"{'prefill' if prefill else 'decode'} step (cache {max_len})",
                step_class(r.model_class, encoder_decoder=ed),
                lambda model: step_inputs(model, prefill=prefill, max_len=max_len, dtype=self.module.dtype),
                capture_step,
                batch, 5 if prefill else 1)
        return self.graphs[key]

    def encoder(self, batch: int):
        """The ``(graph module, plan)`` of an encoder-decoder's encoder (its output gathered)."""
        key = ("encoder", 0)
        if key not in self.graphs:
            r = self._recipe()
            ex = encoder_example(r.config, r.model_class)
            self.graphs[key] = self._capture("encoder", encoder_class(r.model_class), lambda model: ex, None, batch, 8)
        return self.graphs[key]

    def _recipe(self):
        r = self.module.recipe
        if r is None or r.config is None:
            raise ConfigError("generate() needs a module sharded from a Hugging Face model (its class and config "
                              "rebuild the model for the step graphs)")
        return r

    def _capture(self, what: str, cls: type, example, capture_fn, batch: int, seq: int):
        """``cls`` (the model's class with another forward) built on meta, captured for
        ``example(model)`` (rank 0 exports, the others load), planned with the module's policy,
        rewritten for this rank and bound to the module's own parameters."""
        m = self.module
        r = self._recipe()
        t0 = time.perf_counter()
        built = build_meta(r.config, model_class=cls, dtype=m.dtype, adapt=r.adapt)
        built.model.eval()
        cap, p = plan_graph(built, what, example, capture_fn, r.policy, m.plan, batch=batch * m.plan.dp,
                            seq=seq, dropout=r.dropout, capture_with="shared")      # collective
        gm = rewrite_bound(m, cap, p, built)
        self.captures += 1
        logger.info("captured the %s in %.1f s", what, time.perf_counter() - t0)
        return gm, p

    def cache(self, plan, batch: int, max_len: int, device, dtype) -> tuple[list, list]:
        """This rank's blocks of the cache the plan's state inputs describe, zeroed, for
        ``batch`` sequences on this data-parallel replica (the plan's batch is the global
        one, ``dp`` replicas of it)."""
        keys, values = [], []
        for n in plan.nodes:
            if n.kind != "state":
                continue
            g = (batch * plan.dp,) + tuple(n.global_shape[1:-2]) + (max_len, n.global_shape[-1])
            t = torch.zeros(n.out_spec.local_shape(g, plan.mesh), device=device, dtype=dtype)
            (keys if n.name.startswith("cache_keys") else values).append(t)
        return keys, values


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch, as transformers derives them from the mask."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


def _cache_class():
    from transformers.cache_utils import Cache

    class ShardedCache(Cache):
        """The ``past_key_values`` transformers' loop carries between steps: this rank's
        cache blocks and how many positions are filled (enough of the ``Cache``
        protocol for ``generate``)."""

        is_compileable = False

        def __init__(self, keys, values, max_len: int):
            super().__init__(layers=[])
            self.keys, self.values, self.max_len, self.seen = keys, values, max_len, 0

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.seen

        def get_max_cache_shape(self, layer_idx: int = 0) -> int:
            return self.max_len

        def __len__(self) -> int:
            return len(self.keys)

    return ShardedCache


def sharded_lm(module, *, max_len: int, batch: int):
    """A transformers ``GenerationMixin`` model whose forward runs ``module``'s step
    graphs (:class:`Generator`) on a fresh cache of ``max_len`` positions for ``batch``
    sequences; returns ``(lm, cache)``: pass the cache as ``past_key_values``."""
    gen = module.generator
    _, decode_plan = gen.graph(prefill=False, max_len=max_len, batch=batch)
    keys, values = gen.cache(decode_plan, batch, max_len, module.device, module.dtype)
    cache = _cache_class()(keys, values, max_len)
    encoder = _encoder_class()(gen)
    return _lm_class(module, gen, cache, encoder)(), cache


def _lm_class(module, gen: Generator, cache, encoder) -> type:
    """The ``GenerationMixin`` model class over ``gen``'s step graphs: ``module``'s config,
    device and dtype, ``cache`` where the loop passes none, ``encoder`` as its encoder."""
    from transformers import GenerationMixin

    class ShardedLM(GenerationMixin, nn.Module):
        main_input_name = _main_input(module.recipe.model_class) if module.recipe is not None else "input_ids"
        base_model_prefix = "model"         # no base model: transformers' getattr(self, prefix, None) finds none
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

        def get_encoder(self):
            return encoder

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    decoder_input_ids=None, encoder_outputs=None, input_features=None, **kwargs):
            # input_features: read by the encoder graph (get_encoder) before the first step
            c = past_key_values if past_key_values is not None else cache
            return _lm_step(gen, c, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            decoder_input_ids=decoder_input_ids, encoder_outputs=encoder_outputs)

    return ShardedLM


def _lm_step(gen: Generator, c, *, input_ids, attention_mask, position_ids, decoder_input_ids, encoder_outputs):
    """One forward of the generation loop: the prefill or decode step graph run on the
    new tokens and cache ``c`` (its filled length advanced); the transformers output."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, Seq2SeqLMOutput

    seq2seq = encoder_outputs is not None
    ids = decoder_input_ids if seq2seq else input_ids
    b, s = ids.shape
    start = c.seen
    if start + s > c.max_len:
        raise ConfigError(f"generation reached {start + s} positions, over the cache's {c.max_len}")
    # a decoder's tokens are all real
    mask = _step_mask(None if seq2seq else attention_mask, b, start + s, c.max_len, ids.device)
    gm, _ = gen.graph(prefill=s > 1, max_len=c.max_len, batch=b)
    step = dict(input_ids=ids, attention_mask=mask, cache_keys=c.keys, cache_values=c.values,
                cache_position=torch.arange(start, start + s, device=ids.device))
    if seq2seq:
        enc = encoder_outputs[0] if isinstance(encoder_outputs, (tuple, list)) else \
            encoder_outputs.last_hidden_state
        step.update(encoder_hidden_states=enc, encoder_attention_mask=attention_mask if attention_mask
                    is not None else torch.ones(enc.shape[:2], dtype=torch.long, device=ids.device))
    else:
        step["position_ids"] = position_ids if position_ids is not None else \
            _positions(mask[:, :start + s])[:, start:]
    logits = gm(**step)
    c.seen = start + s
    if seq2seq:
        return Seq2SeqLMOutput(logits=logits, past_key_values=c, encoder_last_hidden_state=enc)
    return CausalLMOutputWithPast(logits=logits, past_key_values=c)


def _step_mask(attention_mask, b: int, filled: int, max_len: int, device) -> torch.Tensor:
    """The ``[b, max_len]`` mask of a cache whose first ``filled`` positions hold tokens:
    ``attention_mask``'s, or all real where it is None."""
    mask = torch.zeros(b, max_len, dtype=torch.long, device=device)
    if attention_mask is None:
        mask[:, :filled] = 1
    else:
        mask[:, :filled] = attention_mask[:, :filled]
    return mask


def _encoder_class() -> type:
    """The class of the encoder graph as transformers' ``get_encoder()`` returns it."""
    from transformers.modeling_outputs import BaseModelOutput

    class Encoder(nn.Module):
        """The encoder graph as transformers' ``get_encoder()`` returns it."""

        def __init__(self, gen: Generator):
            super().__init__()
            self.gen = gen

        def forward(self, input_ids=None, attention_mask=None, input_features=None, return_dict=None,
                    output_attentions=None, output_hidden_states=None):
            if input_features is not None:          # log-mel frames (Whisper): no mask
                gm, _ = self.gen.encoder(input_features.shape[0])
                return BaseModelOutput(last_hidden_state=gm(input_features=input_features))
            gm, _ = self.gen.encoder(input_ids.shape[0])
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            return BaseModelOutput(last_hidden_state=gm(input_ids=input_ids, attention_mask=attention_mask))

    return Encoder
