"""``ShardedModule``: the rewritten graph behind the Hugging Face call signature."""

from __future__ import annotations

import math
import os
import weakref

import torch
from torch import fx, nn

from .runtime import collectives as C
from .runtime import parallel_ops
from .runtime.groups import copy_sync_hooks
from .ir.errors import ConfigError
from .ir.plan import GRAD_BUCKET_BYTES, ShardingPlan
from .launch.compile_share import HostShared
from .launch.recapture import capture_graph
from .runtime.selfcheck import run_checked
from .ir.signature import InputSignature, Recipe, SignatureGraph, batch_of, main_input, pad_rows, trim_rows
from .planning.validate import Problem as _P
from .io.gather import unique_params
from .hf_face import ModelFace

try:        # whether dynamo traces the frames the caller calls (torch.compile(sharded) runs forward eagerly)
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback
except ImportError:     # another torch: the graph as it is (dynamo recompiles at a new length)
    def _eval_frame_callback():
        return None

__all__ = ["ShardedModule", "unique_params", "replicas"]

_CUDAGRAPHS_REFUSED = ("{what} captures CUDA graphs, which record each collective once and replay it outside "
                       "c10d's and autoshard's accounting (and a communicator's error handling); valid choices: "
                       "sharded.compile() or torch.compile(sharded) with mode='default' or "
                       "'max-autotune-no-cudagraphs' and no 'triton.cudagraphs' option")


def _cudagraphs_on(callback) -> bool:
    """Whether the torch.compile running ``callback`` (dynamo's frame callback) was asked for
    CUDA graphs (``mode="reduce-overhead"`` / ``"max-autotune"`` set inductor's
    ``triton.cudagraphs``): the backend is found down the wrappers' ``_torchdynamo_orig_backend``."""
    for _ in range(6):
        if callback is None or callback is False:
            return False
        config = getattr(callback, "config", None)
        if isinstance(config, dict) and config.get("triton.cudagraphs"):
            return True
        callback = getattr(callback, "_torchdynamo_orig_backend", None)
    return False


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
        self._hooks = []
        self.debug = debug
        # the first call of each graph (every call under debug) runs node by node and checks
        # every local shape against the plan (autoshard.runtime.selfcheck); False (or AUTOSHARD_SELF_CHECK=0) skips it
        self.self_check = os.environ.get("AUTOSHARD_SELF_CHECK", "1") != "0"
        self._checked: set[int] = set()
        self._ids_checked: set[str] = set()      # signatures whose token ids were range-checked on a GPU
        self._limits: dict = dict(limits or {})
        self._seq_split, self._seq_why = seq_split if isinstance(seq_split, tuple) else (seq_split, "")
        self._compile_kw: dict | None = None     # set by compile(): the graphs run through torch.compile
        self._compile_backend = None              # compile(): its HostShared backend (inductor on ranks)
        self._dynamic_dims = False                # compile(dynamic=True): batch and sequence dims marked dynamic
        self._compiled: dict = {}
        self._config = config
        self._generation_config = None
        self._generator = None       # autoshard.generate.Generator: the step graphs, made on first generate()
        self.adapters = None          # autoshard.adapters.Adapters: the peft adapters of a peft model (shard() sets them)
        self._bucketed = None        # autoshard.runtime.overlap.BucketedGradSync after overlap_grad_sync()
        self._eager_copies: dict = {}   # id(graph) -> its copy with the eager passes (prefetch_weights, async_tp)
        self._compile_copies: dict = {}  # id(graph) -> its copy for torch.compile (grad-mode blocks inlined)
        self._prefetch_on, self._async_chunks = False, 1
        self._device_mesh = None     # torch's DeviceMesh over self.mesh, made on first use (autoshard.io.dtensor)
        self._blocks_split = False   # split_blocks(): the blocks run as modules, no new graph is captured
        self.block_paths: tuple[str, ...] = ()      # the blocks split_blocks() made modules the graph calls
        self.overlap_grad_sync(GRAD_BUCKET_BYTES)   # bucketed by default (the plan's comms count buckets)
        # a kv head held by several ranks: its copies' gradients summed (tensor hooks, kept through set_grad_sync)
        self._copy_hooks = copy_sync_hooks(self.plan, self.rank, dict(self.named_parameters(remove_duplicate=False)))
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
        self._drop_grad_hooks()
        for p, group in self._synced_params(exclude):
            self._hooks.append(p.register_hook(_sync_hook(group)))

    def clear_grad_sync(self) -> None:
        """Remove the gradient hooks (:meth:`set_grad_sync`): whoever takes the
        parameters over syncs their gradients (FSDP2, :mod:`autoshard.runtime.fsdp`)."""
        self._drop_grad_hooks()

    def _drop_grad_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._bucketed is not None:
            self._bucketed.remove()
            self._bucketed = None

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
        from .runtime.overlap import BucketedGradSync

        self._drop_grad_hooks()
        params = self._synced_params(exclude)
        self._bucketed = BucketedGradSync(params, bucket_bytes, {name: label for label, name in self.groups.items()})

    def _synced_params(self, exclude: tuple[str, ...]) -> list:
        """(parameter, group name) for every trainable parameter whose gradient the plan syncs
        over axes not in ``exclude`` (process groups created as needed, collectively). A
        frozen one (``requires_grad=False``) has no gradient to sync and takes no hook."""
        params = dict(self.named_parameters(remove_duplicate=False))
        out = []
        for pp in self.plan.params:
            axes = tuple(a for a in pp.grad_sync if a not in exclude)
            if not axes or pp.name not in params or not pp.trainable or not params[pp.name].requires_grad:
                continue
            out.append((params[pp.name], self.group_name(axes)))
        return out

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
        self._compiled, self._generator = {}, None
        self._eager_copies, self._compile_copies = {}, {}

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
        from torch.distributed.tensor import DTensor

        from .io.dtensor import from_dtensor, like_fsdp

        plans = self.plan.params_by_name()
        local = type(state_dict)() if isinstance(state_dict, dict) else {}
        for k, v in state_dict.items():
            pp = plans.get(k)
            if isinstance(v, DTensor):
                v = from_dtensor(self, pp, v) if pp is not None else v.full_tensor()
            elif pp is not None and isinstance(v, torch.Tensor):
                gshape = tuple(pp.global_shape)
                if tuple(v.shape) == pp.hf_shape and pp.pad_dim is not None:
                    v = pp.pad(v.detach())      # a dense tensor of a padded vocabulary
                if tuple(v.shape) == gshape and pp.spec.local_shape(gshape, self.mesh) != gshape:
                    v = pp.spec.local(v.detach(), self.mesh, self.rank)
            local[k] = v
        if hasattr(state_dict, "_metadata"):
            local._metadata = state_dict._metadata
        params = dict(self.named_parameters(remove_duplicate=False))
        for k, v in local.items():      # FSDP2's parameters take their own dp chunk of the TP-local block
            p = params.get(k)
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
                local[k] = like_fsdp(p, v)
        return super().load_state_dict(local, strict=strict, assign=assign)

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
        if _cudagraphs_on(_eval_frame_callback()):      # torch.compile(sharded, mode="reduce-overhead")
            raise ConfigError(_CUDAGRAPHS_REFUSED.format(what="torch.compile(sharded, mode='reduce-overhead')"))
        kwargs, answer = self._bind(args, kwargs)
        g, full, b, padded, run = self._prepare(kwargs)
        if self._compile_kw is not None:
            if self._dynamic_dims:
                full = _mark_dynamic(g, full)
        elif run is g.gm and _eval_frame_callback() not in (None, False):
            # torch.compile(sharded): this frame runs eagerly (skipped), dynamo traces the graph's frame
            run = self._compile_copy(g)
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
        kwargs = _on_device({k: v for k, v in kwargs.items() if v is not None}, self.device)
        if kwargs.get("use_cache"):
            raise ConfigError("use_cache=True: a sharded module's forward runs without a KV cache (its graphs are "
                              "captured with use_cache=False); call it without use_cache, or decode with "
                              "sharded.generate(...), which keeps a sharded static cache")
        self._check_inputs(kwargs)
        g, full = self._graph_for(kwargs)
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
        from .generate import LEN_QUANTUM, sharded_lm

        if self.mesh.cp > 1:
            raise ConfigError(f"generate() on a module sharded with cp={self.mesh.cp}: a decode step holds "
                              f"one token, which the sequence split cannot share; generate with a module sharded "
                              f"without cp (the same weights: save_checkpoint, then shard(..., cp=1))")

        if input_features is not None:
            rows, p = self._feature_rows(input_features.to(self.device)), 1      # decoding from the start token
        else:
            if input_ids is None:
                raise ConfigError("generate() takes input_ids [batch, prompt length] (or input_features for a "
                                  "speech encoder-decoder)")
            input_ids = input_ids.to(self.device)
            if input_ids.dim() != 2:
                raise ConfigError(f"generate() takes input_ids [batch, prompt length], got shape "
                                  f"{list(input_ids.shape)}")
            mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(self.device)
            rows, p = {"input_ids": input_ids, "attention_mask": mask}, input_ids.shape[1]
        b = next(iter(rows.values())).shape[0]
        gc = kwargs.get("generation_config") or self.generation_config
        new = kwargs.get("max_new_tokens") or gc.max_new_tokens or max(int(gc.max_length or 20) - p, 1)
        need = p + int(new)
        if max_len is None:
            max_len = -(-need // LEN_QUANTUM) * LEN_QUANTUM
            lim = self._limits.get("max_positions")
            if lim and max_len > lim[1]:
                max_len = max(need, lim[1])
        if need > max_len:
            raise ConfigError(f"generate(): prompt {p} + {new} new tokens need {need} cache positions, "
                              f"max_len={max_len}")
        sample = kwargs.get("do_sample")
        if sample is None:
            sample = getattr(gc, "do_sample", False)
        if sample:
            from .runtime.groups import check_same_rng

            check_same_rng(self.mesh.size(self.mesh.axes), "generate(do_sample=True)",
                           "the ranks would sample different tokens", "before generate()")
        split = self.batch_split
        padded = b + (-b % split)
        # rows beyond the batch: copies of the last prompt, cut from every output
        rows = pad_rows(rows, b, padded, tuple(rows))
        lm, cache = sharded_lm(self, max_len=max_len, batch=padded)
        out = lm.generate(**rows, past_key_values=cache, **kwargs)
        return out if padded == b else trim_rows(out, b, padded)

    def _feature_rows(self, features: torch.Tensor) -> dict:
        """:meth:`generate`'s inputs for an encoder-decoder led by log-mel frames
        ``[batch, mel bins, frames]`` (Whisper)."""
        from .generate import is_encoder_decoder

        if not is_encoder_decoder(self.config) or features.dim() != 3:
            raise ConfigError(f"generate(input_features=...) takes an encoder-decoder's log-mel frames [batch, mel "
                              f"bins, frames]; got shape {list(features.shape)} for {type(self).__name__} "
                              f"(encoder-decoder: {is_encoder_decoder(self.config)})")
        return {"input_features": features}

    def generation_plan(self, step: str = "decode", max_len: int | None = None) -> ShardingPlan:
        """The plan of a :meth:`generate` step graph (``"decode"``: one token, ``"prefill"``:
        the prompt) for cache length ``max_len`` (default: the latest captured): its
        collectives are per token, its ``state`` rows the KV cache each rank holds
        (:attr:`~autoshard.ir.plan.ShardingPlan.state_bytes_per_rank`)."""
        graphs = self._generator.graphs if self._generator is not None else {}
        keys = [k for k in graphs if k[0] == (step == "prefill") and (max_len is None or k[1] == max_len)]
        if step not in ("decode", "prefill") or not keys:
            raise ConfigError(f"no {step!r} step graph" + (f" for max_len={max_len}" if max_len else "")
                              + f"; steps: 'decode', 'prefill'; captured: "
                              f"{sorted(('prefill' if k[0] else 'decode', k[1]) for k in graphs) or 'none (call generate first)'}")
        return graphs[keys[-1]][1]

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
        if self._compile_kw is not None or self._eager_passes_on:
            raise ConfigError("split_blocks() after compile(), prefetch_weights() or async_tp(): split the blocks first")
        keys = split_blocks(self._graphs[0].gm, checkpoint=checkpoint)
        self._blocks_split = True
        self._compile_copies = {}
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
        if kwargs.get("mode") in ("reduce-overhead", "max-autotune"):
            # both capture CUDA graphs, which would record each c10d call once and replay it
            # without the ledger or the communicator seeing a new call
            raise ConfigError(f"compile(mode={kwargs['mode']!r}) captures CUDA graphs, which replay the collectives "
                              f"outside c10d's and autoshard's accounting; valid choices: mode='default' or "
                              f"'max-autotune-no-cudagraphs'")
        if (kwargs.get("options") or {}).get("triton.cudagraphs"):
            raise ConfigError(_CUDAGRAPHS_REFUSED.format(what="compile(options={'triton.cudagraphs': True})"))
        self._dynamic_dims = kwargs.get("dynamic") is True
        self._compile_kw = {k: v for k, v in kwargs.items() if not (k == "dynamic" and v is True)}
        self._compile_backend = None if once_per_host is False else \
            HostShared.for_compile(self._compile_kw, once_per_host)
        self._compiled = {}
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
        self._prefetch_on, self._eager_copies = bool(on), {}
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
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ConfigError(f"async_tp(chunks={chunks!r}): a whole number of row blocks >= 1 (1 turns it off; "
                              f"2 is the usual choice)")
        self._async_chunks, self._eager_copies = chunks, {}
        return self

    @property
    def _eager_passes_on(self) -> bool:
        return self._prefetch_on or self._async_chunks > 1

    def _eager_copy(self, gm):
        """``gm`` with the eager passes this module has on: weight prefetching, then
        asynchronous row-parallel Linears."""
        if self._prefetch_on:
            from .passes.prefetch import prefetch_weights

            gm = prefetch_weights(gm)[0]
        if self._async_chunks > 1:
            from .passes.async_tp import async_row_linears

            gm = async_row_linears(gm, self._async_chunks)[0]
        return gm

    def _runner(self, g):
        """``g``'s graph module, compiled once per graph after :meth:`compile` (with its
        weight gathers launched early after :meth:`prefetch_weights`, its row-parallel
        Linears pipelined after :meth:`async_tp`)."""
        if self._compile_kw is None:
            if self._eager_passes_on:
                if id(g) not in self._eager_copies:
                    self._eager_copies[id(g)] = self._eager_copy(g.gm)
                return self._eager_copies[id(g)]
            return g.gm
        fn = self._compiled.get(id(g))
        if fn is None:
            gm = self._compile_copy(g)
            kw = self._compile_kw
            if self._compile_backend is not None:      # inductor, the host's first rank first
                kw = {k: v for k, v in kw.items() if k not in ("backend", "mode", "options")}
                kw["backend"] = self._compile_backend
            fn = self._compiled[id(g)] = torch.compile(gm, **kw)
        return fn

    @torch.compiler.disable
    def _compile_copy(self, g):
        """``g``'s graph as ``torch.compile`` takes it: its grad-mode blocks inlined
        (:mod:`autoshard.passes.grad_blocks`: dynamo breaks at them with a dynamic
        size), one copy per graph."""
        gm = self._compile_copies.get(id(g))
        if gm is None:
            from .passes.grad_blocks import inline_grad_blocks

            gm = self._compile_copies[id(g)] = inline_grad_blocks(g.gm)
        return gm

    def _graph_for(self, kwargs: dict):
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
        from .runtime.compare import compare

        kwargs = _on_device({k: v for k, v in batch.items() if v is not None}, self.device)
        g, full = self._graph_for(kwargs)
        b = batch_of(full) or 0
        if self.batch_split > 1 and b % self.batch_split:
            raise ConfigError(f"compare: batch size {b} does not divide the batch split "
                              f"{self.batch_split}; use a multiple of {self.batch_split}")
        from .passes.row_order import LOCAL_ROWS_NOTE
        from .runtime.groups import axes_label

        local_rows = frozenset(n.name for n in g.plan.nodes if LOCAL_ROWS_NOTE in n.notes)

        def reduce(t, axes):        # a partial sum, summed over its axes (every rank reaches the same nodes)
            group = self.groups.get(axes_label(axes))
            return None if group is None else C.all_reduce(t.detach().clone(), group, "sum")

        with torch.no_grad(), parallel_ops.dropout_active(self.training):
            _, rows = compare(g.gm, self.mesh, full, dense_values, rank=self.rank, atol=atol, rtol=rtol,
                              reduce=reduce, local_rows=local_rows)
        return rows

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
        import torch.distributed as dist

        from .launch.pipeline import PIPELINE, layout_state
        from .policies import POLICIES
        from .runtime.compare import Comparison, merge, record

        kwargs = {k: v for k, v in batch.items() if v is not None}
        prepared = PIPELINE.run(layout_state(POLICIES[self.plan.mode](self.plan.mesh), model=dense_model,
                                             example_inputs=kwargs), "capture", "prepare").prepared
        dev = next((p.device for p in dense_model.parameters()), torch.device("cpu"))
        with torch.no_grad():
            values = record(prepared.module, {k: v for k, v in {**_on_device(kwargs, dev), **prepared.constants}.items()
                                              if k in prepared.input_names})
        local = kwargs
        if "dp" in self.mesh.axes:      # this replica's rows of the global batch
            b = batch_of(kwargs)
            per = b // self.mesh.size("dp")
            lo = self.coords["dp"] * per
            local = {k: v[lo:lo + per] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == b
                     else v for k, v in kwargs.items()}
        rows = self.compare_values({k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                                    for k, v in values.items()}, local, atol=atol, rtol=rtol)
        every = [None] * dist.get_world_size() if dist.is_initialized() else [rows]
        if dist.is_initialized():
            dist.all_gather_object(every, rows)
        kinds = {n.name: (n.kind, n.module or "") for n in self.plan.nodes}
        return Comparison(merge(every), kinds)

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
        adapters = getattr(self, "adapters", None)
        if adapters is not None and not merged:
            adapters.save(self, path)
            return
        if adapters is not None:
            from .io.gather import save_merged
            save_merged(self, path, adapters.merged, config=config, max_shard_size=max_shard_size)
            return
        from .io.gather import save_pretrained
        save_pretrained(self, path, config=config, max_shard_size=max_shard_size)


def _on_device(kwargs: dict, device: torch.device) -> dict:
    """``kwargs`` with every tensor on ``device`` (no copy where it is there already)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) and v.device != device else v for k, v in kwargs.items()}


def _sync_hook(group: str):
    def hook(grad):
        return C.all_reduce(grad, group, "sum")
    return hook


def replicas(pp, mesh) -> int:
    """Ranks holding an identical copy of this rank's block: product of the sizes of
    the mesh axes the parameter is not split over (dp included)."""
    split = set(pp.spec.axes)
    return math.prod(s for a, s in zip(mesh.axes, mesh.sizes) if a not in split)


# ------------------------------------------------------ gradient norms
def grad_norm(sharded, only=None) -> torch.Tensor:
    """The global L2 norm of all gradients (``only``: of these parameters' gradients), each
    dense entry counted once (collective: every rank passes the same parameters)."""
    import torch.distributed as dist

    total = torch.zeros((), dtype=torch.float64, device=sharded.device)     # NCCL reduces device tensors only
    keep = None if only is None else {id(p) for p in only}
    for pp, p in unique_params(sharded):
        if p.grad is None or (keep is not None and id(p) not in keep):
            continue
        g, copies = local_grad(p), replicas(pp, sharded.mesh)
        if g is not p.grad:         # FSDP2: this rank's dp chunk of the TP block, held once over dp
            copies //= sharded.mesh.dp
        total += g.detach().double().pow(2).sum() / copies
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt()


def local_grad(p) -> torch.Tensor:
    """``p.grad``, or its local tensor where FSDP2 made it a DTensor over ``dp``."""
    g = p.grad
    return g.to_local() if hasattr(g, "to_local") else g


# ------------------------------------------------------ torch's clip_grad_norm_
# torch.nn.utils.clip_grad_norm_ on a sharded module's parameters would compute the norm of
# this rank's local gradients only (plain tensors: a TP block of some, a replica of others).
# Its total norm comes from torch.nn.utils.clip_grad._get_total_norm and the scaling from
# _clip_grads_with_norm_; the first ShardedModule wraps both so that gradients of a live sharded module
# get their global norm (grad_norm, as autoshard.training.train.clip_grad_norm_) and are scaled as
# ours are (FSDP2's DTensor gradients through their local chunks), every other call passing
# through to torch.
_SHARDED: "weakref.WeakSet" = weakref.WeakSet()


def track(sharded) -> None:
    """Let torch's ``clip_grad_norm_`` see ``sharded``'s gradients as sharded (see above)."""
    _SHARDED.add(sharded)
    import torch.nn.utils.clip_grad as cg

    if getattr(cg, "_get_total_norm", None) is None or getattr(cg._get_total_norm, "_autoshard", False):
        return
    torch_total_norm = cg._get_total_norm

    def _get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        found = _owner(ts)
        if found is None:
            return torch_total_norm(ts, norm_type, error_if_nonfinite, foreach)
        if float(norm_type) != 2.0:
            raise ConfigError(f"torch.nn.utils.clip_grad_norm_(norm_type={norm_type}) on a sharded module's parameters: "
                              f"only the L2 norm is global here; use norm_type=2 or "
                              f"autoshard.training.train.clip_grad_norm_(sharded, max_norm)")
        norm = grad_norm(*found)
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(f"the total norm of order 2.0 for the gradients of the sharded module is non-finite "
                               f"({norm.item()}), so it cannot be clipped")
        return norm.float()

    torch_clip_with_norm = cg._clip_grads_with_norm_

    def _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        ps = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _owner([p.grad for p in ps if p.grad is not None]) is None:
            return torch_clip_with_norm(ps, max_norm, total_norm, foreach)
        coef = (float(max_norm) / (total_norm + 1e-6)).clamp(max=1.0)     # torch's coefficient
        for p in ps:            # FSDP2's DTensor gradients: their local chunks, as clip_grad_norm_ above
            if p.grad is not None:
                local_grad(p).mul_(coef.to(p.grad.dtype))

    _get_total_norm._autoshard = True
    cg._get_total_norm = _get_total_norm
    if getattr(cg, "_clip_grads_with_norm_", None) is not None:
        cg._clip_grads_with_norm_ = _clip_grads_with_norm_


def _owner(grads: list) -> tuple | None:
    """``(sharded, params)`` when ``grads`` are gradients of one tracked sharded module's
    parameters; None when none is; an error naming ours when they mix."""
    if not grads:
        return None
    ids = {id(g) for g in grads}
    for sharded in list(_SHARDED):
        params = [p for p in sharded.parameters() if p.grad is not None and id(p.grad) in ids]
        if not params:
            continue
        if len(params) != len(ids):
            raise ConfigError(f"torch.nn.utils.clip_grad_norm_ got {len(params)} gradients of a sharded module and "
                              f"{len(ids) - len(params)} other tensors: their total norm has no one meaning across "
                              f"ranks; clip the sharded module's own with "
                              f"autoshard.training.train.clip_grad_norm_(sharded, max_norm)")
        return sharded, params
    return None


@torch.compiler.disable
def _mark_dynamic(g, full: dict) -> dict:
    """``full`` with its batch and sequence dims marked dynamic where ``g`` keeps them
    symbolic (``maybe_mark_dynamic``: dynamo may still specialise one), so that the
    first compile is the one for every size (``compile(dynamic=True)``). The marks go on views: the caller's
    tensors stay unmarked for whatever else it compiles."""
    import torch._dynamo

    dims = {name: d for name, _, d in g.signature.tensors}
    batch, seq = g.static_batch is None, not g.static_seq
    out = dict(full)
    for name, t in full.items():
        marks = [i for i, d in enumerate(dims.get(name, ()) if isinstance(t, torch.Tensor) else ())
                 if (d == "b" and batch) or (d == "s" and seq)]
        if marks:
            out[name] = t.view_as(t)
            for i in marks:
                torch._dynamo.maybe_mark_dynamic(out[name], i)
    return out
