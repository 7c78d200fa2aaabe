"""The face of autoshard: :func:`shard` and :func:`plan`."""

from __future__ import annotations

import os
from .ir.heap import collector_paused
from .ir.log import quiet_on_other_ranks

import torch
import torch.distributed as dist

from .ir.errors import ConfigError, ShardingError
from .module import ShardedModule
from .adapters import unwrap
from .hf_face import bind_call, embedding_names, forward_names
from .ir.signature import Recipe
from .ir.plan import ShardingPlan
from .config import ShardConfig
from .launch.launched import Launched
from .launch.pipeline import PIPELINE, LaunchState
from .passes.capture import Captured
from .policies import POLICIES, make_policy
from .io.builder import model_from, skeleton
from .runtime.heartbeat import stale_after
from .runtime.heartbeat import start as start_heartbeat
from .io.hf_fill import open_folder
from .runtime.device import bind_user_group, check_model_device, init_process_group, rank_device
from .runtime.timeout import timeout_seconds
from .planning.validate import (Problem, check_batch, check_dims, check_environment, check_example_inputs, check_group,
                       check_min_seq, check_model, check_seq, raise_problems)

__all__ = ["shard", "plan", "validate", "MODES"]

MODES = tuple(POLICIES)


def _ensure_dist() -> None:
    """Join the torchrun job, with a bounded collective timeout (``AUTOSHARD_TIMEOUT``
    seconds, default :data:`autoshard.runtime.timeout.DEFAULT_TIMEOUT_S`): a dead or stuck rank
    becomes an error on the others instead of a hang. A process group the caller made
    keeps its own timeout. Under NCCL each rank binds its own GPU, ``cuda:LOCAL_RANK``
    (:func:`autoshard.runtime.device.init_process_group`); in a group the caller made,
    :func:`~autoshard.runtime.device.bind_user_group` makes it current."""
    if dist.is_available() and dist.is_initialized():
        bind_user_group()
        return
    raise_problems(check_environment(os.environ), "autoshard.shard")
    init_process_group(timeout_s=timeout_seconds())


def validate(model: torch.nn.Module, *, mode: str, world_size: int, depth: int | None = None, dp: int = 1,
             example_inputs: dict | None = None, weights_given: bool = False, environ=None, cp: int = 1,
             cp_attention: str = "ring", cp_order: str = "balanced"):
    """Every problem :func:`shard` would refuse or warn about, found without a collective.

    Returns ``(policy or None, problems)``. Pure: the same arguments give the same
    list on every rank, so every rank raises the same error before the first
    collective. ``mode='auto'`` checks only what does not depend on the layout."""
    problems: list[Problem] = []
    if environ is not None:
        problems += check_group(world_size, environ)
    pol = None
    if mode != "auto":
        try:
            pol = make_policy(mode, world_size, depth, dp, cp, cp_attention, cp_order)
        except ConfigError as e:
            problems.append(Problem("mode" if mode not in POLICIES else "mesh", str(e)))
    problems += check_model(model, weights_given=weights_given)
    config = getattr(model, "config", None)
    if config is None and example_inputs is None:       # nothing to make example inputs from
        from .passes.capture import default_example_inputs

        try:
            default_example_inputs(model)
        except ConfigError as e:
            problems.append(Problem("example_inputs", str(e)))
    if pol is not None:
        problems += check_dims(config, pol)
    # a batch that does not divide the batch split is padded (refused later only where
    # padding would not be exact: autoshard.ir.signature.pad_blocker)
    problems += check_example_inputs(example_inputs, config=config)
    return pol, problems


@quiet_on_other_ranks
@collector_paused()
def shard(model: "torch.nn.Module | str | os.PathLike", *, mode: str = "auto", depth: int | None = None, dp: int = 1,
          example_inputs: dict | None = None, gather_logits: bool = True,
          captured: Captured | None = None, weights=None, cluster=None, debug: bool = False,
          activation_checkpointing: bool = False, dropout: str = "sharded", seed: int | None = None,
          sequence_parallel: bool = False, device: "torch.device | str | None" = None,
          fsdp: bool = False, cp: int = 1, cp_attention: str = "ring", cp_order: str = "balanced",
          ep: int = 1, pp: int = 1, schedule: str | None = None) -> ShardedModule:
    """Shard ``model`` over the ranks of the default process group.

    Every rank calls it with the same model (same weights); each keeps its slices.
    ``model`` may also be the path of a local Hugging Face folder: it is built on the
    meta device from its ``config.json`` and each rank reads only its own slices of the
    safetensors (as :func:`autoshard.from_pretrained`); the module comes back in eval
    mode, as transformers' ``from_pretrained`` returns a model (``.train()`` turns its
    dropout on).

    The module takes what the model's forward takes (``input_ids``, ``attention_mask``,
    ``token_type_ids``, ``labels`` or none, ...), at any batch size: a call whose
    inputs no graph has yet captures one (once per input signature, about the cost of
    the first capture; :mod:`autoshard.ir.signature`), and a batch that does not divide the
    batch split is padded and trimmed, exactly.
    ``example_inputs`` (HF kwargs) fix which inputs the module takes and the batch
    shape the plan's communication figures are computed for. ``weights(gm, plan,
    rank)``, if given, fills the rewritten module's parameters and buffers (e.g.
    from files, for a model built on meta) before the ShardedModule is built.
    ``mode="auto"`` picks the cheapest TP layout for this world size and ``dp`` on
    ``cluster`` (a preset name, a :class:`~autoshard.planning.cost.Cluster`, e.g. from
    :func:`autoshard.profile`; default: guessed from the device), see
    :func:`autoshard.search`.

    Every input is checked first, on every rank alike (see :mod:`autoshard.planning.validate`):
    a bad one raises one :class:`~autoshard.ir.errors.ConfigError` listing every problem
    before any collective. ``debug=True`` makes each call of the module compare a
    checksum of its inputs across the TP ranks of a replica (one small all-gather)
    and raise if they differ. ``activation_checkpointing=True`` recomputes each
    repeated block (every numbered module, e.g. ``layers.3``) in backward instead of
    keeping its activations (:mod:`autoshard.passes.remat`); the block's forward
    collectives then run a second time in backward.

    The options (``dropout``, ``seed``, ``sequence_parallel``, ``device``, ``fsdp``, ``cp``,
    ``cp_attention``, ``cp_order``, ``ep``, ``pp``, ``schedule``) are read into one frozen
    :class:`~autoshard.config.ShardConfig`, checked before anything else; its docstring says
    what each does. The launch then runs :mod:`autoshard.launch.pipeline`'s stages.

    Example (under ``torchrun --nproc-per-node 2``)::

        sharded = autoshard.shard(model, mode="1d")
        out = sharded(input_ids=ids, labels=ids.clone())
        out.loss.backward()
    """
    cfg = ShardConfig.of(mode=mode, sequence_parallel=sequence_parallel, depth=depth, dp=dp, cp=cp,
                         cp_attention=cp_attention, cp_order=cp_order, ep=ep, pp=pp, schedule=schedule,
                         dropout=dropout, gather_logits=gather_logits, fsdp=fsdp, device=device, cluster=cluster,
                         activation_checkpointing=activation_checkpointing, debug=debug, seed=seed)
    return _shard(model, cfg, example_inputs=example_inputs, captured=captured, weights=weights)


def _shard(model, cfg: ShardConfig, *, example_inputs, captured, weights) -> ShardedModule:
    """:func:`shard` of a checked config: the model's checks, then the launch pipeline."""
    if cfg.pipelined:       # pipeline stages: autoshard.pipeline_parallel
        from .pipeline_parallel import shard_pipelined

        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        return shard_pipelined(model, cfg, example_inputs=example_inputs, ensure_dist=_ensure_dist,
                               weights=weights, captured=captured)
    if isinstance(model, (str, os.PathLike)):
        if weights is not None:
            raise ConfigError("shard(path) reads the weights from the folder: pass weights= only with a model")
        src = open_folder(model, train=True)
        sharded = _shard(src.model, cfg, example_inputs=example_inputs, captured=None, weights=src.fill)
        sharded.config, sharded.load_stats = src.config, src.stats
        return sharded.eval()       # as transformers' from_pretrained returns it; .train() turns dropout on
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"shard() takes a torch.nn.Module (e.g. a transformers model) or the path of a local "
                          f"Hugging Face folder (config.json + safetensors), got {type(model).__name__}"
                          + (f" {model!r}" if isinstance(model, (int, float, bytes)) else ""))
    model, adapters = unwrap(model)     # a peft wrapper: its injected model (autoshard.adapters)
    if isinstance(example_inputs, (tuple, list)):       # positional, as the model is called
        example_inputs = bind_call(forward_names(model), tuple(example_inputs), {}, "example_inputs")
    state = _launch_state(model, cfg, example_inputs=example_inputs, captured=captured, weights=weights)
    launched = PIPELINE.launch(state, PIPELINE.key(state))
    # with fsdp the blocks are checkpointed as the FSDP units they become (fully_shard_dp), not outlined here
    built = _finish(model, launched, rank=state.rank, weights=weights, debug=cfg.debug,
                    activation_checkpointing=cfg.activation_checkpointing and not cfg.fsdp,
                    gather_logits=cfg.gather_logits, dropout=cfg.dropout, adapters=adapters)
    out = PIPELINE.run(state.but(module=built), "place").module
    if cfg.fsdp:
        from .runtime.fsdp import fully_shard_dp
        fully_shard_dp(out, checkpoint=cfg.activation_checkpointing)
    return out


def _launch_state(model, cfg: ShardConfig, *, example_inputs, captured, weights) -> LaunchState:
    """The pipeline's first state for this rank: the job joined, the device and every
    input checked alike on every rank (before any collective but the join), the layout
    made (``mode="auto"``: left to the pipeline's search)."""
    stale_after()           # a bad AUTOSHARD_HEARTBEAT is refused before any collective
    _ensure_dist()
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device(cfg.device) if cfg.device is not None else rank_device()
    check_model_device(model, device)
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    pol, problems = validate(model, mode=cfg.mode, world_size=world, depth=cfg.depth, dp=cfg.dp,
                             example_inputs=example_inputs, weights_given=weights is not None, environ=os.environ,
                             cp=cfg.cp, cp_attention=cfg.cp_attention, cp_order=cfg.cp_order)
    raise_problems(problems, f"autoshard.shard(mode={cfg.mode!r}) on {world} ranks")
    if cfg.ep > 1 and pol is not None:      # the experts over the dp (× cp) ranks (passes.experts.plan_expert_parallel;
        pol.ep = cfg.ep                     # "auto": the search's candidates carry it)
    return LaunchState(config=cfg, model=model, example_inputs=example_inputs, world_size=world, rank=rank,
                       captured=captured, policy=pol, frozen=_frozen(model), checks="launch", device=device)


def _frozen(model) -> frozenset[str]:
    """Names of ``model``'s parameters with ``requires_grad=False`` (the plan's frozen ones:
    a capture, shared or cached, may come from a model frozen otherwise)."""
    return frozenset(n for n, t in model.named_parameters(remove_duplicate=False) if not t.requires_grad)


def _finish(model, launched: Launched, *, rank: int, weights, debug: bool, activation_checkpointing: bool,
            gather_logits: bool, dropout: str, adapters=None) -> ShardedModule:
    """The ShardedModule of this rank's launch (weights filled, blocks checkpointed);
    ``adapters``: the peft adapters ``model`` carries (:mod:`autoshard.adapters`)."""
    gm, p, pol, facts = launched.gm, launched.plan, launched.policy, launched.facts
    if activation_checkpointing:
        from .passes.remat import checkpoint_blocks

        checkpoint_blocks(gm)
    if weights is not None:
        weights(gm, p, rank)
    config = getattr(model, "config", None)
    recipe = Recipe(
        model_class=type(model), config=config, training=facts.training, policy=pol,
        batch_size=facts.batch_size, seq_len=facts.seq_len, gather_outputs=gather_logits, dropout=dropout,
        activation_checkpointing=activation_checkpointing, adapt=adapters.inject if adapters is not None else None,
        skeleton=skeleton(model) if config is None else None)      # no config: recaptured from a meta copy
    sm = ShardedModule(gm, p, rank=rank, groups=launched.groups, input_names=facts.input_names,
                       constants=facts.constants, example_inputs=facts.example_inputs, debug=debug,
                       recipe=recipe, batch_inputs=facts.batch_inputs, pad_blocker=facts.pad_blocker,
                       limits=_input_limits(config, facts.seq_range), seq_split=(pol.seq_split(), pol.seq_split_why()), config=config,
                       model_tensors=_tensor_names(model))
    sm.adapters = adapters
    sm._call_names, sm._embedding_names = forward_names(model), embedding_names(model)
    start_heartbeat()       # a frozen rank now ends the job in AUTOSHARD_HEARTBEAT s, not the collective timeout
    return sm


def _tensor_names(model: torch.nn.Module) -> frozenset:
    """The names of ``model``'s parameters and buffers (tied ones under each name)."""
    return frozenset(n for n, _ in model.named_parameters(remove_duplicate=False)) | \
        frozenset(n for n, _ in model.named_buffers(remove_duplicate=False))


def _plans_at(state: LaunchState) -> bool:
    """Whether ``state`` plans (at a shorter sequence: a failure at a longer one then blames the length)."""
    try:
        PIPELINE.run(state, "plan")
    except ShardingError:
        return False
    return True


def _input_limits(config, seq_range: tuple | None = None) -> dict:
    """What a call's inputs are checked against: vocabulary and positions (the lower of
    the model's maximum and the longest sequence the capture was proven for, ``seq_range``)."""
    out = {}
    for key, names in (("vocab_size", ("vocab_size",)), ("max_positions", ("max_position_embeddings", "n_positions"))):
        for n in names:
            v = getattr(config, n, None) if config is not None else None
            if isinstance(v, int) and v > 0:
                out[key] = (n, v)
                break
    hi = seq_range[1] if seq_range is not None else None
    if seq_range is not None and seq_range[0] == seq_range[1]:    # a static sequence: one graph per length
        out["static_seq"] = seq_range[0]
        return out
    if hi is not None and hi < out.get("max_positions", ("", hi + 1))[1]:      # capture had to exclude longer ones
        out["max_positions"] = (f"captured range (torch.export proved the graph for seq <= {hi})", hi)
    return out


@collector_paused()
def plan(model_or_config, *, world_size: int = 8, mode: str = "auto", depth: int | None = None, dp: int = 1,
         batch_size: int = 8, seq_len: int = 128, example_inputs: dict | None = None,
         cluster=None, dropout: str = "sharded", sequence_parallel: bool = False, step: str | None = None,
         max_len: int | None = None, cp: int = 1, cp_attention: str = "ring",
         cp_order: str = "balanced", ep: int = 1, pp: int = 1, schedule: str | None = None,
         micro_batches: int | None = None) -> ShardingPlan:
    """Plan without processes or weights (the model is built on the meta device).

    Example:
        >>> from transformers import LlamaConfig
        >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
        >>> p = plan(cfg, world_size=4, mode="2d", batch_size=4, seq_len=16)
        >>> p.mesh.axes, p.param("lm_head.weight").spec
        (('row', 'col'), [S(col), S(row)])

    ``pp=P`` plans pipeline stages (see :func:`shard`) and returns a
    :class:`~autoshard.pipeline_parallel.PipelinePlan` instead: the mode's plan of one
    stage's ranks, the stages (blocks, bytes, time) and the priced bubble of
    ``micro_batches`` per step (default ``pp``) of ``batch_size`` rows each.

    ``mode="auto"`` returns the best plan of :func:`autoshard.search` on ``cluster``
    (default ``"dgx-a100"``); there ``batch_size`` is the global batch, and depth and
    dp are searched unless given (dp > 1 pins dp), and so is the context-parallel size
    (cp > 1 pins it), and so is expert parallelism for a model with experts (ep > 1 pins it:
    the plan's first grouped matmul notes why ep or expert-TP was chosen).
    ``sequence_parallel=True`` with ``mode="1d"`` is ``mode="1d-sp"``
    (see :func:`shard`). ``cp=C`` adds a context-parallel axis (see :func:`shard`);
    ``ep=E`` spreads the experts (see :func:`shard`): the plan's all-to-alls are priced at
    their bytes under uniform routing.

    ``step="decode"`` (or ``"prefill"``) plans what :meth:`ShardedModule.generate` runs
    per token (per prompt) instead: the model's step with a static KV cache of
    ``max_len`` positions (default ``seq_len`` rounded up to 64) for ``batch_size``
    sequences, its parameters laid out as the model's plan lays them; its ``state``
    rows and :attr:`~autoshard.ir.plan.ShardingPlan.state_bytes_per_rank` are the cache
    each rank holds, its collectives those of one token
    (:func:`autoshard.planning.cost.forward_latency` predicts the per-token time).
    """
    cfg = ShardConfig.of(entry="plan", mode=mode, sequence_parallel=sequence_parallel, depth=depth, dp=dp,
                         cluster=cluster, dropout=dropout, cp=cp, cp_attention=cp_attention, cp_order=cp_order,
                         ep=ep, pp=pp, schedule=schedule)
    if cfg.pipelined:       # pipeline stages: a PipelinePlan (autoshard.pipeline_parallel)
        from .pipeline_plan import plan_pipeline

        return plan_pipeline(model_or_config, world_size=world_size, mode=cfg.mode, pp=pp, schedule=schedule,
                             depth=depth, dp=dp, batch_size=batch_size, seq_len=seq_len, micro_batches=micro_batches,
                             cluster=cfg.search_cluster(), example_inputs=example_inputs, dropout=dropout)
    if step is not None:
        return _plan_step(model_or_config, cfg, world_size=world_size, batch_size=batch_size, seq_len=seq_len,
                          example_inputs=example_inputs, step=step, max_len=max_len)
    if cfg.mode == "auto":
        from .planning.search import search

        return search(model_or_config, world_size=world_size, cluster=cfg.search_cluster(), depth=depth,
                      dp=dp if dp != 1 else None, batch_size=batch_size, seq_len=seq_len,
                      example_inputs=example_inputs, cp=cp if cp != 1 else None, cp_attention=cp_attention,
                      cp_order=cp_order, ep=ep if ep != 1 else None).plan
    return _plan_layout(model_or_config, cfg, world_size=world_size, batch_size=batch_size, seq_len=seq_len,
                        example_inputs=example_inputs)


def _plan_step(model_or_config, cfg: ShardConfig, *, world_size: int, batch_size: int, seq_len: int,
               example_inputs, step: str, max_len: int | None) -> ShardingPlan:
    """:func:`plan` with ``step=``: the generation step laid out as the model's own plan."""
    from .generate import LEN_QUANTUM, plan_step

    # the model's own plan fixes the parameter layouts the step keeps; they do not depend on the
    # sequence length, so a short one plans it (a long one may pass the model's maximum positions)
    held = plan(model_or_config, world_size=world_size, mode=cfg.mode, depth=cfg.depth, dp=cfg.dp,
                batch_size=batch_size, seq_len=min(seq_len, 128), example_inputs=example_inputs,
                cluster=cfg.cluster, dropout=cfg.dropout)
    pol = make_policy(held.mode, held.mesh.world_size,           # the layout chosen (auto: searched)
                      held.mesh.size("dep") if "dep" in held.mesh.axes else None, held.dp)
    length = max_len or -(-seq_len // LEN_QUANTUM) * LEN_QUANTUM
    return plan_step(model_from(model_or_config), pol, held, step=step, max_len=length, batch=batch_size)


def _plan_layout(model_or_config, cfg: ShardConfig, *, world_size: int, batch_size: int, seq_len: int,
                 example_inputs) -> ShardingPlan:
    """:func:`plan` of a concrete layout: the pipeline's capture, prepare and plan stages
    on the model built on meta; a sequence past a learned-position table is blamed by name."""
    pol = cfg.policy(world_size)
    pol.ep = cfg.ep             # expert parallelism (see shard()): the plan shows its all-to-alls
    split, label = pol.batch_split()
    if pol.dp > 1:          # the plan's batch is the global one: dp replicas cut it first
        split, label = split * pol.dp, f"dp[{pol.dp}]" + (f" × {label}" if label else "")
    where = f"autoshard.plan(mode={cfg.mode!r})"
    raise_problems(check_batch(batch_size, split, label, source="batch_size")
                   + check_seq(seq_len, pol.seq_split(), source="seq_len", why=pol.seq_split_why()), where)
    model = model_from(model_or_config)
    model.train()
    state = PIPELINE.run(LaunchState(config=cfg, model=model, example_inputs=example_inputs, world_size=world_size,
                                     capture_with="for_plan", policy=pol), "capture", "prepare")
    try:
        planned = PIPELINE.run(state.but(batch_size=batch_size, seq_len=seq_len), "plan").plan
        raise_problems(check_min_seq(seq_len, planned, source="seq_len"), where)
        return planned
    except ShardingError as e:
        name, most = _input_limits(getattr(model, "config", None)).get("max_positions", ("", seq_len))
        if seq_len > most and _plans_at(state.but(batch_size=batch_size, seq_len=most)):
            # a learned-position table shorter than the planned sequence: the model plans at its maximum
            raise ConfigError(f"autoshard.plan: seq_len={seq_len} is longer than the model's {name}={most}; "
                              f"plan with seq_len <= {most} (planning failed at: {str(e).splitlines()[0]})") from e
        raise
