"""``ShardedModule``: the rewritten graph behind the Hugging Face call signature."""

from __future__ import annotations

import os

import torch
from torch import fx, nn

from .runtime import parallel_ops
from .runtime.device import on_device
from .runtime.groups import copy_sync_hooks
from .ir.errors import ConfigError
from .ir.plan import GRAD_BUCKET_BYTES, ShardingPlan
from .launch.recapture import capture_graph
from .runtime.selfcheck import run_checked
from .ir.signature import InputSignature, Recipe, SignatureGraph, batch_of, main_input, pad_rows, trim_rows
from .planning.validate import Problem as _P
from .io.gather import unique_params
from .hf_face import ModelFace
from .sharded import compare as comparing
from .sharded import generation
from .sharded import state as states
from .sharded.compile import CUDAGRAPHS_REFUSED, Compiler, cudagraphs_on, eval_frame_callback, mark_dynamic
from .sharded.eager import EagerPasses, check_chunks
from .sharded.grads import GradSync, replicas, track

__all__ = ["ShardedModule", "unique_params", "replicas"]


class ShardedModule(ModelFace, nn.Module):
    """One rank's part of a sharded model.

    Takes the keyword arguments of the Hugging Face model it came from and
    returns the same ``ModelOutput`` (``loss`` is the global mean, identical on
    every rank; ``logits`` are full unless sharded with ``gather_logits=False``).
    Its parameters are local slices under the Hugging Face names; gradients of
    replicated parameters are all-reduced over the axes the plan names as soon
    as backward produces them.

    It answers as the model does: ``.config``, ``.generation_config``, ``.device``,
    ``.dtype``. State: ``state_dict()`` gives DTensors under HF names (each mode's
    layout as placements, :mod:`autoshard.io.dtensor`), as torch's
    ``get_model_state_dict`` does; ``state_dict(local=True)`` this rank's local slices;
    ``full_state_dict()`` the dense tensors (collective); ``load_state_dict`` takes
    any of the three and slices a dense one through the plan::

        sharded.load_state_dict(dense_model.state_dict())     # every rank, no collective
        dcp.save(sharded.state_dict(), checkpoint_id="ckpt", planner=autoshard.io.dcp.SavePlanner())
    """

    def __init__(self, gm: fx.GraphModule, plan: ShardingPlan, *, rank: int, groups: dict[str, str],
                 input_names: tuple[str, ...], constants: dict, example_inputs: dict, debug: bool = False,
                 batch_inputs: frozenset = frozenset(), pad_blocker: str | None = None, recipe: "Recipe | None" = None,
                 limits: dict | None = None, seq_split: int | tuple[int, str] = 1, config=None, model_tensors: frozenset = frozenset()):
        """Wrap this rank's rewritten ``gm`` (what :func:`autoshard.shard` builds).

        Args:
            gm: the rewritten graph module; its children become this module's (HF names).
            plan: the plan ``gm`` was rewritten under.
            rank: this rank in the default process group.
            groups: axes label -> process-group name.
            input_names: the keyword arguments the graph takes, in order.
            constants: non-tensor keyword arguments baked into the graph.
            example_inputs: the inputs the graph was captured with (its signature).
            debug: compare a checksum of each call's inputs across the TP ranks.
            batch_inputs: the inputs whose first dim is the batch.
            pad_blocker: why padding the batch would not be exact, or None.
            recipe: how to rebuild the model for a new graph (None: no recapture, no generate).
            limits: ``{"vocab_size": (name, n), "max_positions": (name, n)}`` a call's
                inputs are checked against.
            seq_split: what a call's sequence length must divide (1d-sp: the TP size; cp: 2·cp
                balanced, cp contiguous), or that and why (for the refusal's message).
            config: the Hugging Face config of the model sharded.
            model_tensors: the names of the model's parameters and buffers: those of
                ``gm``'s own (top-level) tensors among them are this module's too (the
                others are constants export lifted out of the forward).
        """
        super().__init__()
        object.__setattr__(self, "_gm", gm)          # not registered: its children are ours (HF names)
        static_seq = (limits or {}).get("static_seq") is not None
        first = SignatureGraph(gm, plan, tuple(input_names), dict(constants),
                               InputSignature.of(example_inputs, static_batch=not batch_inputs, static_seq=static_seq),
                               frozenset(batch_inputs), pad_blocker, static_seq)
        object.__setattr__(self, "_graphs", [first])
        self._recipe = recipe
        self._adopt(gm, model_tensors)
        self.plan = plan
        self.rank = rank
        self.groups = groups
        self.mesh = plan.mesh
        self.coords = plan.mesh.coords(rank)
        self._grad_sync = GradSync()     # the gradient hooks (autoshard.sharded.grads)
        self.debug = debug
        # the first call of each graph (every call under debug) runs node by node and checks
        # every local shape against the plan (autoshard.runtime.selfcheck); False (or AUTOSHARD_SELF_CHECK=0) skips it
        self.self_check = os.environ.get("AUTOSHARD_SELF_CHECK", "1") != "0"
        self._checked: set[int] = set()
        self._ids_checked: set[str] = set()      # signatures whose token ids were range-checked on a GPU
        self._limits: dict = dict(limits or {})
        self._seq_split, self._seq_why = seq_split if isinstance(seq_split, tuple) else (seq_split, "")
        self._compiler = Compiler()      # compile(): its settings and compiled graphs (autoshard.sharded.compile)
        self._config = config
        self._generation_config = None
        self._generator = None       # autoshard.generate.Generator: the step graphs, made on first generate()
        self.adapters = None          # autoshard.adapters.Adapters: the peft adapters of a peft model (shard() sets them)
        self._eager = EagerPasses()      # prefetch_weights, async_tp (autoshard.sharded.eager)
        self._device_mesh = None     # torch's DeviceMesh over self.mesh, made on first use (autoshard.io.dtensor)
        self._blocks_split = False   # split_blocks(): the blocks run as modules, no new graph is captured
        self.block_paths: tuple[str, ...] = ()      # the blocks split_blocks() made modules the graph calls
        # a kv head held by several ranks: its copies' gradients summed (tensor hooks, kept through set_grad_sync).
        # Registered before the gradient sync's hooks, which run after them: a parameter synced over another
        # axis too (2.5d's dep) hands the bucket its gradient and keeps zeros, so a copy sum run after the
        # bucket's hook would sum zeros and the bucket would write back the unsummed gradient
        self._copy_hooks = copy_sync_hooks(self.plan, self.rank, dict(self.named_parameters(remove_duplicate=False)))
        self.overlap_grad_sync(GRAD_BUCKET_BYTES)   # bucketed by default (the plan's comms count buckets)
        track(self)         # torch's clip_grad_norm_ on these parameters: the global norm (see track)

    def _adopt(self, gm: fx.GraphModule, model_tensors: frozenset) -> None:
        """Take ``gm``'s children and the model's top-level tensors as this module's, in
        the model's order (its own tensors first, as ``nn.Module.state_dict`` lists them):
        BART's ``final_logits_bias`` is in ``state_dict()`` and loads as the children's
        tensors do, persistent or not as the model registered it."""
        persistent = set(gm.state_dict(keep_vars=True))
        for name, p in gm.named_parameters(recurse=False):
            if name in model_tensors:
                self.register_parameter(name, p)
        for name, b in gm.named_buffers(recurse=False):
            if name in model_tensors:
                self.register_buffer(name, b, persistent=name in persistent)
        for name, child in gm.named_children():
            if not name.startswith("_"):
                self.add_module(name, child)

    def set_grad_sync(self, exclude: tuple[str, ...] = ()) -> None:
        """(Re-)register the gradient hooks that all-reduce each parameter's gradient, one
        blocking call per parameter (the default is bucketed: :meth:`overlap_grad_sync`),
        over its plan's ``grad_sync`` axes, leaving out the axes in ``exclude`` (ZeRO-2
        reduce-scatters the ``dp`` part itself: :mod:`autoshard.training.zero`). Collective when
        a new axes subset needs a process group (call on every rank)."""
        self._grad_sync.per_parameter(self, exclude)

    def clear_grad_sync(self) -> None:
        """Remove the gradient hooks (:meth:`set_grad_sync`): whoever takes the
        parameters over syncs their gradients (FSDP2, :mod:`autoshard.runtime.fsdp`)."""
        self._grad_sync.clear()

    def overlap_grad_sync(self, bucket_bytes: int | None = 1 << 20, exclude: tuple[str, ...] = ()) -> None:
        """All-reduce the gradients in buckets of about ``bucket_bytes``, launched
        asynchronously during backward so they travel while autograd computes the next
        gradients (:mod:`autoshard.runtime.overlap`; DDP-style). Exact, and fewer calls than the
        plan's per-parameter list (the ledger counts buckets). The default, at
        :data:`~autoshard.ir.plan.GRAD_BUCKET_BYTES` (25 MiB), which the plan's
        :meth:`~autoshard.ir.plan.ShardingPlan.comms` counts. ``None``: back to one
        blocking all-reduce per parameter (:meth:`set_grad_sync`). Collective where a
        process group is new (call on every rank)."""
        if bucket_bytes is None:
            return self.set_grad_sync(exclude)
        self._grad_sync.bucketed(self, bucket_bytes, exclude)

    def group_name(self, axes: tuple[str, ...]) -> str:
        """The name of this rank's process group over ``axes`` (its rank-independent
        alias, :func:`~autoshard.runtime.groups.group_alias`; c10d resolves it): the
        plan's own, else created (collectively: every rank asks in the same order) and
        kept with them."""
        from .runtime.groups import axes_label, group_alias, mesh_group

        label = axes_label(axes)
        if label not in self.groups:
            mesh_group(self.mesh, axes, self.rank)
            self.groups[label] = group_alias(self.mesh, axes)
        return self.groups[label]

    # -- looks like the Hugging Face model
    @property
    def config(self):
        """The Hugging Face config of the model this module was sharded from (None if unknown)."""
        return self._config

    @config.setter
    def config(self, value) -> None:
        self._config = value

    @property
    def generation_config(self):
        """The model's generation config: the one set, else derived from :attr:`config`."""
        if self._generation_config is None and self._config is not None:
            from transformers import GenerationConfig

            self._generation_config = GenerationConfig.from_model_config(self._config)
        return self._generation_config

    @generation_config.setter
    def generation_config(self, value) -> None:
        self._generation_config = value

    @property
    def device(self) -> torch.device:
        """Device of the local parameters."""
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the floating local parameters (the first one's)."""
        return next((p.dtype for p in self.parameters() if p.is_floating_point()), torch.get_default_dtype())

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (behind ``.to`` / ``.cuda`` / ``.half`` ...), and where the
        device changes, everything ``nn.Module`` does not see follows: the device
        literals of every captured graph, their lifted constants, and the caches built
        for the old device (compiled graphs, prefetching copies, generation steps)."""
        old = self.device
        out = super()._apply(fn, recurse)
        new = self.device
        if new != old:
            self._retarget(new)
        return out

    def _retarget(self, device: torch.device) -> None:
        from .runtime.device import retarget

        for g in self._graphs:
            retarget(g.gm, device)
        self._generator = None
        self._compiler.reset()
        self._eager.reset()

    def place(self, device: "torch.device | str") -> "ShardedModule":
        """Move this rank's slices to ``device`` and point every graph at it (its device
        literals and constants too, even where they named another device, as a graph
        captured on another rank's GPU does). Returns the module."""
        device = torch.device(device)
        if any(t.is_meta for t in list(self.parameters()) + list(self.buffers())):
            return self         # not materialised (sharded on meta without weights): nothing to move yet
        self.to(device)
        self._retarget(device)
        self._device_mesh = None     # its device type follows the tensors'
        return self

    def __repr__(self) -> str:
        p = self.plan
        local = sum(t.numel() * t.element_size() for t in self.parameters())
        return (f"ShardedModule({p.model}, mode={p.mode}, mesh={self.mesh}, rank={self.rank}, "
                f"params={len(p.params)}, local_bytes={local:,})")

    def state_dict(self, *args, local: bool = False, **kwargs):
        """The module's tensors under their Hugging Face names: planned tensors as
        DTensors on :attr:`device_mesh` (placements from the plan; a padded vocabulary at
        its Hugging Face size), what torch's ``get_model_state_dict`` and DCP expect.
        ``local=True``: this rank's local tensors (our own checkpoint format's view).
        Outside a process group the local tensors (no mesh to place them on)."""
        sd = super().state_dict(*args, **kwargs)
        import torch.distributed as dist

        if local or not dist.is_initialized() or args or kwargs.get("prefix"):
            return sd
        from .io.dtensor import dtensor_state_dict
        return dtensor_state_dict(self, sd)

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 holds the parameters (``shard(..., fsdp=True)``): DTensors of dp chunks."""
        from torch.distributed.tensor import DTensor

        return any(isinstance(p, DTensor) for p in self.parameters())

    @property
    def device_mesh(self):
        """The ``torch.distributed.DeviceMesh`` over this module's mesh (axis names as the
        plan's), on the plan's own process groups."""
        if self._device_mesh is None:
            from .io.dtensor import device_mesh
            self._device_mesh = device_mesh(self)
        return self._device_mesh

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load this rank's local state dict, a DTensor one, or a full (dense) one, as
        DTensor / FSDP2 do.

        A tensor of a planned parameter with the global shape (where that differs
        from the local one) is sliced to this rank's block through the plan's spec
        (:meth:`~autoshard.ir.spec.ShardSpec.local`); local tensors load as they are;
        DTensors laid out as the plan lays them give their local tensors (others are
        gathered whole and sliced: collective). No collective otherwise: every rank
        slices its own part."""
        return super().load_state_dict(states.local_state_dict(self, state_dict), strict=strict, assign=assign)

    @property
    def batch_split(self) -> int:
        return self.mesh.size(self.plan.batch_axes) if self.plan.batch_axes else 1

    @property
    def recipe(self) -> "Recipe | None":
        """How :func:`autoshard.shard` made this module: the model's class and config, the
        policy and options (what a new graph is captured, planned and rewritten with);
        None where the model was not a transformers model with a config."""
        return self._recipe

    @property
    def limits(self) -> dict:
        """What a call's inputs are checked against: ``{"vocab_size": (name, n),
        "max_positions": (name, n)}`` (each where known; a copy)."""
        return dict(self._limits)

    @property
    def generator(self):
        """The :class:`autoshard.generate.Generator` holding :meth:`generate`'s step graphs
        (made on first use)."""
        if self._generator is None:
            from .generate import Generator

            self._generator = Generator(self)
        return self._generator

    @property
    def model_class(self) -> type | None:
        """The class of the model this module was sharded from (None if not a transformers model)."""
        return self._recipe.model_class if self._recipe is not None else None

    @property
    def signatures(self) -> list[str]:
        """The input signatures this module has a graph for, in capture order (see
        :mod:`autoshard.ir.signature`); a call with another one captures a new graph."""
        return [g.signature.describe() for g in self._graphs]

    @torch.compiler.disable(recursive=False)
    def forward(self, *args, **kwargs):
        """Run the graph captured for this call's inputs (capturing one first if no
        graph has them). A batch that does not divide the batch split is padded and
        the padded rows cut from the outputs (exact; see :mod:`autoshard.ir.signature`).
        Positional arguments bind to the model's own parameter names (:mod:`autoshard.hf_face`).

        ``torch.compile(sharded)`` compiles the graph in one piece, with no break: this
        method and the input checks, graph lookup and padding it runs are outside the
        compiled region by design (dynamo skips their frames, not a break), so the first
        frame it compiles is the graph module's own, one per captured signature."""
        if cudagraphs_on(eval_frame_callback()):      # torch.compile(sharded, mode="reduce-overhead")
            raise ConfigError(CUDAGRAPHS_REFUSED.format(what="torch.compile(sharded, mode='reduce-overhead')"))
        kwargs, answer = self._bind(args, kwargs)
        g, full, b, padded, run = self._prepare(kwargs)
        if self._compiler.on:
            if self._compiler.dynamic_dims:
                full = mark_dynamic(g, full)
        elif run is g.gm and eval_frame_callback() not in (None, False):
            # torch.compile(sharded): this frame runs eagerly (skipped), dynamo traces the graph's frame
            run = self._compiler.copy(g)
        with parallel_ops.dropout_active(self.training):     # sharded.eval() turns dropout off, as in the model
            out = run(**full)
        return answer(self._trim(out, b, padded) if padded != b else out)

    @staticmethod
    @torch.compiler.disable
    def _trim(out, b: int, padded: int):
        return trim_rows(out, b, padded)

    @torch.compiler.disable
    def _prepare(self, kwargs: dict):
        """The eager half of :meth:`forward`: inputs moved to the module's device and
        checked, the graph for them found (or captured), the batch padded; returns
        ``(graph, its keyword arguments, batch, padded batch, what to run)``. The first
        call of each graph runs under the self-check (every node's local shape against
        the plan), eagerly."""
        kwargs = on_device({k: v for k, v in kwargs.items() if v is not None}, self.device)
        if kwargs.get("use_cache"):
            raise ConfigError("use_cache=True: a sharded module's forward runs without a KV cache (its graphs are "
                              "captured with use_cache=False); call it without use_cache, or decode with "
                              "sharded.generate(...), which keeps a sharded static cache")
        self._check_inputs(kwargs)
        g, full = self.graph_for(kwargs)
        split = self.batch_split
        b = padded = batch_of(full) or 0
        if split > 1 and b % split:
            if g.pad_blocker is not None:
                raise ConfigError(f"batch size {b} is not divisible by the batch split {split} "
                                  f"({'·'.join(self.plan.batch_axes)}) and padding it would not be exact: "
                                  f"{g.pad_blocker}; use a multiple of {split}, e.g. "
                                  f"{max(split, b - b % split)} or {b - b % split + split}")
            padded = b + split - b % split
            full = pad_rows(full, b, padded, g.batch_inputs)
        if self.debug:
            self._check_same_inputs(full, g.input_names)
        if self.self_check and (self.debug or id(g) not in self._checked):
            self._checked.add(id(g))
            return g, full, b, padded, torch.compiler.disable(
                lambda **kw: run_checked(g.gm, self.mesh, kw, self.plan.dp))
        return g, full, b, padded, self._runner(g)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, *,
                 max_len: int | None = None, input_features: torch.Tensor | None = None, **kwargs):
        """Hugging Face ``generate`` on this sharded causal LM, with a static KV cache that
        is itself sharded as the plan shards attention (:mod:`autoshard.generate`).

        Takes what ``model.generate`` takes (``max_new_tokens``, ``do_sample``,
        ``temperature``, ``top_k``, ``eos_token_id``, ``return_dict_in_generate``, ...) and
        returns what it returns, identical on every rank. Batched prompts are left-padded
        with their ``attention_mask``. ``max_len``: positions the cache holds (default:
        prompt + new tokens, rounded up to a multiple of 64); the prefill and decode
        graphs are captured once per ``max_len`` and reused. Sampling draws from the
        default generator, which must be in the same state on every rank (seed it alike:
        checked). Call on every rank with the same inputs.

        A speech encoder-decoder (Whisper) takes ``input_features`` (log-mel frames) in
        place of ``input_ids`` and decodes from its ``decoder_start_token_id``, as
        transformers' ``GenerationMixin.generate`` does (the start token leads each
        output; Whisper's own ``generate`` extras, timestamps and language detection,
        are not run).

        Example (under ``torchrun``)::

            out = sharded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32)

        Refused (before any collective) on a module with context parallelism (``cp > 1``):
        a decode step has one token, which no sequence split can share.
        """
        return generation.generate(self, input_ids, attention_mask, max_len=max_len, input_features=input_features,
                                   **kwargs)

    def generation_plan(self, step: str = "decode", max_len: int | None = None) -> ShardingPlan:
        """The plan of a :meth:`generate` step graph (``"decode"``: one token, ``"prefill"``:
        the prompt) for cache length ``max_len`` (default: the latest captured): its
        collectives are per token, its ``state`` rows the KV cache each rank holds
        (:attr:`~autoshard.ir.plan.ShardingPlan.state_bytes_per_rank`)."""
        return generation.generation_plan(self, step, max_len)

    def split_blocks(self, *, checkpoint: bool = False) -> list[str]:
        """Make each repeated block of the model (``model.layers.3``) a module the graph
        calls, at its own path, with its own children and parameters
        (:mod:`autoshard.passes.blocks`): what per-block tools (FSDP2's ``fully_shard``
        per block) need. Names and ``state_dict()`` do not change. Returns the block paths.
        Afterwards the module runs only the graphs it has: a call with new input shapes
        that would need another capture is refused."""
        from .passes.blocks import split_blocks

        if len(self._graphs) > 1:
            raise ConfigError(f"split_blocks() on a module with {len(self._graphs)} graphs: call it right after "
                              f"shard(), before calls with other input signatures")
        if self._compiler.on or self._eager.on:
            raise ConfigError("split_blocks() after compile(), prefetch_weights() or async_tp(): split the blocks first")
        keys = split_blocks(self._graphs[0].gm, checkpoint=checkpoint)
        self._blocks_split = True
        self._compiler.drop_copies()
        self.block_paths = tuple(keys)
        return keys

    def compile(self, *, once_per_host: bool | None = None, **kwargs) -> "ShardedModule":
        """Run every graph of this module (those captured later too) through
        :func:`torch.compile` (``kwargs`` go to it, e.g. ``dynamic=False``); the
        input checks and batch padding around them stay eager, so the graphs compile
        without a break. The CUDA-graph modes (``"reduce-overhead"``, ``"max-autotune"``)
        are refused: a captured graph replays its collectives unseen. The collectives are custom ops with fake kernels: each stays
        one node of the compiled graph. Returns the module (in place, like
        :meth:`torch.nn.Module.compile`).

        ``dynamic``: as :func:`torch.compile`'s — None (default) compiles the first call's
        sizes and, at the first other size, once more with them symbolic; False keeps
        every size static; True marks the dims the graph keeps symbolic (batch, sequence)
        dynamic from the first call, so one compile serves every length (only those:
        ``torch.compile(dynamic=True)`` would make every dim symbolic). The graph compiled
        has its grad-mode blocks inlined (:mod:`autoshard.passes.grad_blocks`), so a
        dynamic compile is one graph with no break.

        ``once_per_host`` (inductor, the default backend): True, the lowest rank of each
        host compiles each graph while the host's other ranks wait, then they load it
        from inductor's caches (every rank's graph is the same program,
        :mod:`autoshard.launch.compile_share`); False, every rank compiles at once; None
        (default), True where a host runs more ranks than it has cores (there the
        compiles compete for them), else False.

        Example (under ``torchrun``)::

            sharded = autoshard.shard(model, mode="1d").compile()
            sharded(**batch).loss.backward()          # the first call compiles
        """
        self._compiler.configure(once_per_host, kwargs)
        return self

    def prefetch_weights(self, on: bool = True) -> "ShardedModule":
        """Launch each SUMMA / 3D Linear's weight all-gather one Linear early, so the
        weight travels while the Linear ahead computes (:mod:`autoshard.passes.prefetch`;
        2d, 2.5d and 3d: 1d gathers no weights). Exact: the same collectives, bytes and
        results, issued in the same order on every rank. Eager only: after
        :meth:`compile` the graphs run without it. ``on=False`` turns it off. Returns
        the module.

        Example (under ``torchrun``)::

            sharded = autoshard.shard(model, mode="2d").prefetch_weights()
        """
        self._eager.set_prefetch(on)
        return self

    def async_tp(self, chunks: int = 2) -> "ShardedModule":
        """Asynchronous tensor parallelism (1d, 1d-sp): cut each row-parallel Linear's
        rows into ``chunks`` blocks and launch each block's all-reduce (1d-sp: the
        reduce-scatter of a block of the batch) while the next block multiplies
        (:mod:`autoshard.passes.async_tp`). Exact; the plan is unchanged,
        the ledger counts ``chunks`` calls per such Linear (the plan's bytes in all).
        Eager only: after :meth:`compile` the graphs run without it. ``chunks=1``
        turns it off. Whether it pays is the host's: ``benchmarks/bench_async_tp.py``
        times it, :func:`autoshard.planning.cost.estimate` (``async_tp=``) predicts it.
        Returns the module.

        Example (under ``torchrun``)::

            sharded = autoshard.shard(model, mode="1d").async_tp(2)
        """
        check_chunks(chunks)        # before any state is touched
        self._eager.set_chunks(chunks)
        return self

    def _runner(self, g):
        """What runs for graph ``g``: its compiled copy after :meth:`compile`, else its
        graph module (with its weight gathers launched early after :meth:`prefetch_weights`,
        its row-parallel Linears pipelined after :meth:`async_tp`)."""
        if self._compiler.on:
            return self._compiler.compiled(g)
        return self._eager.graph(g)

    def graph_for(self, kwargs: dict):
        """The graph whose captured signature this call matches, and the call's full
        keyword arguments for it (constants filled in, a missing attention mask as
        ones); captures a new graph if none matches."""
        for g in self._graphs:
            full = g.accepts(kwargs)
            if full is not None:
                return g, full
        if self._recipe is None:
            g = self._graphs[0]
            raise ConfigError(f"inputs {InputSignature.of(kwargs).describe()} do not match the captured "
                              f"{g.signature.describe()}, and this module cannot capture another graph (it was "
                              f"not sharded from a Hugging Face model with a config); pass example_inputs with "
                              f"these inputs to shard()")
        if self._blocks_split:
            g = self._graphs[0]
            raise ConfigError(f"inputs {InputSignature.of(kwargs).describe()} do not match the captured "
                              f"{g.signature.describe()}, and this module's blocks run as modules (split_blocks(), "
                              f"fsdp=True), so it captures no other graph; shard with example_inputs of these shapes")
        # a graph whose batch export made static (the model reads it as a Python int: CLIP's
        # contrastive loss, LLaVA's per-sample features): another batch size is captured anew
        static = next((g for g in self._graphs if g.static_batch is not None), None)
        batch = batch_of(kwargs) if static is not None else None
        if batch is not None and batch < 2:
            raise ConfigError(f"batch size {batch}: this module's graphs are captured per batch size (torch.export "
                              f"made the batch static: {static.signature.describe()}), and export cannot capture "
                              f"a batch of 1 apart from other sizes; call it with a batch of 2 or more")
        g = capture_graph(self, kwargs, batch=batch)
        self._graphs.append(g)
        full = g.accepts(kwargs)
        if full is None:        # the capture was made from these very inputs
            raise ConfigError(f"internal: the graph captured for {InputSignature.of(kwargs).describe()} "
                              f"does not accept them")
        return g, full

    def _check_inputs(self, full: dict) -> None:
        """Shapes and dtypes a call must have; local and cheap (no collective)."""
        from .planning.validate import check_example_inputs

        ids = full.get("input_ids")
        if not isinstance(ids, torch.Tensor):       # images, audio: the inputs agree on the batch
            problems = check_example_inputs(full) if main_input(full) is not None else []
        else:
            problems = [p for p in check_example_inputs(full) if "capture needs" not in p.message]
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            s = ids.shape[1]
            if s < 2:
                problems.append(_P("input_ids", f"sequence length {s}: the graph was captured for seq >= 2"))
            if self._seq_split > 1 and s % self._seq_split:
                from .planning.validate import check_seq
                problems += check_seq(s, self._seq_split, source="input_ids", why=self._seq_why)
            if s < self.plan.min_seq_len:
                from .planning.validate import check_min_seq
                problems += check_min_seq(s, self.plan, source="input_ids")
            lim = self._limits.get("max_positions")
            if lim and s > lim[1]:
                problems.append(_P("input_ids", f"sequence length {s} exceeds the model's {lim[0]}={lim[1]}"))
            voc = self._limits.get("vocab_size")
            # the range check reads the ids on the host: on an accelerator that is a sync per
            # call, so there it runs once per input signature (every call under debug)
            on_host = ids.device.type == "cpu" or self.debug
            if ids.device.type == "meta":       # no values (a simulated run: tests/test_simulated_gpus.py)
                voc = None
            sig = None if on_host else InputSignature.of(full).describe()      # keyed only off the host
            if voc and ids.numel() and not ids.dtype.is_floating_point and (on_host or sig not in self._ids_checked):
                if sig is not None:
                    self._ids_checked.add(sig)
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0 or hi >= voc[1]:
                    problems.append(_P("input_ids", f"token ids span {lo}..{hi}, outside the vocabulary "
                                                    f"0..{voc[1] - 1} (a vocab-parallel embedding would "
                                                    f"silently read zeros)"))
        if problems:
            from .planning.validate import raise_problems
            raise_problems(problems, "ShardedModule call")

    def _check_same_inputs(self, full: dict, input_names) -> None:
        """``debug=True``: every TP rank of a data-parallel replica must see the same
        inputs. Each rank all-gathers a checksum per input (numel, sum, position-weighted
        sum, in float64) over the default group and compares it with its replica's ranks;
        every rank reaches the same verdict from the same gathered table."""
        import torch.distributed as dist

        from .runtime.device import comm_device

        names = [n for n in input_names if isinstance(full.get(n), torch.Tensor)]
        rows = []
        for n in names:
            x = full[n].detach().reshape(-1).to("cpu", torch.float64)
            w = torch.arange(x.numel(), dtype=torch.float64, device="cpu") % 9973 + 1
            rows.append(torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device="cpu"), x.sum(), (x * w).sum()]))
        mine = (torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64, device="cpu")).to(comm_device())
        world = dist.get_world_size()
        table = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(table, mine)
        table = [t.cpu() for t in table]
        dp_of = (lambda r: self.mesh.coords(r)["dp"]) if "dp" in self.mesh.axes else (lambda r: 0)
        bad = []
        for i, n in enumerate(names):
            by_replica: dict = {}
            for r in range(world):
                by_replica.setdefault(dp_of(r), {}).setdefault(tuple(table[r][i].tolist()), []).append(r)
            for rep, sums in sorted(by_replica.items()):
                if len(sums) > 1:
                    groups = "; ".join(f"ranks {rs} see numel={int(k[0])} checksum={k[2]:.12g}" for k, rs in sums.items())
                    bad.append(f"{n!r}" + (f" (dp replica {rep})" if "dp" in self.mesh.axes else "") + f": {groups}")
        if bad:
            raise ConfigError("debug: inputs differ between the TP ranks of a replica, which must all be called "
                              "with the same batch (dp replicas may differ): " + " | ".join(bad))

    def graph_module(self) -> fx.GraphModule:
        return self._gm

    def compare_values(self, dense_values: dict, batch: dict, *, atol: "float | dict" = 1e-5,
                       rtol: float = 1e-5) -> list:
        """Run this rank's graph for ``batch`` (this replica's rows) node by node and compare
        each planned node with its block of ``dense_values`` (the dense graph's node values on
        the global batch, every replica's rows: a loss is the global mean on every rank;
        :func:`autoshard.runtime.compare.record`). Collective: every rank calls it (a partial
        sum is summed over its axes to be compared). ``atol`` may map node names to their own
        tolerance. Returns this rank's :class:`~autoshard.runtime.compare.NodeDiff` rows in
        graph order."""
        return comparing.compare_values(self, dense_values, batch, atol=atol, rtol=rtol)

    def compare(self, dense_model: nn.Module, batch: dict, *, atol: float = 1e-5, rtol: float = 1e-5):
        """Debugging aid for a running job: each planned node's output against the dense
        model's on a real batch, merged over every rank (collective: every rank calls it with
        the same global ``batch``, every dp replica's rows; each runs its replica's rows
        through its graph; ``dense_model`` has the weights the sharded one
        was made from, e.g. the model before :func:`autoshard.shard`). Run both models with
        dropout off (``.eval()``, or the module in eval mode) for an exact comparison.

        Returns a :class:`~autoshard.runtime.compare.Comparison`: ``rows`` in graph order,
        ``first_mismatch``, ``table()``. Example (under ``torchrun``)::

            cmp = sharded.compare(dense, {"input_ids": ids, "labels": ids})
            if cmp.first_mismatch:
                print(cmp.first_mismatch.name, cmp.first_mismatch.max_abs)
        """
        return comparing.compare(self, dense_model, batch, atol=atol, rtol=rtol)

    # -- checkpoints: autoshard.io.gather and autoshard.io.sharded_format (collective: call on every rank)
    def full_state_dict(self, rank0_only: bool = True) -> dict:
        """Dense tensors under HF names (tied aliases included), gathered tensor by tensor;
        the counterpart of ``state_dict()`` (local slices). Call on every rank; with
        ``rank0_only`` the other ranks get ``{}``."""
        from .io.gather import full_state_dict
        return full_state_dict(self, rank0_only=rank0_only)

    def save_checkpoint(self, path, optimizer=None) -> None:
        """Sharded checkpoint (a safetensors file per rank + manifest); see autoshard.load_checkpoint."""
        from .io.sharded_format import save_checkpoint
        save_checkpoint(self, path, optimizer)

    def save_pretrained(self, path, *, config=None, max_shard_size="5GB", merged: bool = False) -> None:
        """Dense Hugging Face folder (config.json + safetensors) that transformers loads.

        A module sharded from a peft model (:attr:`adapters`) writes what
        ``peft_model.save_pretrained(path)`` writes: ``adapter_config.json`` and
        ``adapter_model.safetensors`` (dense), which ``PeftModel.from_pretrained(base,
        path)`` loads; ``merged=True`` writes the base model with the adapters merged into
        its weights instead (peft's ``merge_and_unload``), a folder transformers loads.
        Collective: call on every rank (rank 0 writes)."""
        states.save_pretrained(self, path, config=config, max_shard_size=max_shard_size, merged=merged)

