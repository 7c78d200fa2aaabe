"""The face of autoshard: :func:`shard` and :func:`plan`."""

from __future__ import annotations

import functools
import gc
import os
from .ir.log import quiet_on_other_ranks, warn

import torch
import torch.distributed as dist

from .ir.errors import AutoshardWarning, ConfigError, ShardingError
from .ir.kernels import Dropout, check_dropout_mode
from .module import ShardedModule
from .adapters import unwrap
from .hf_face import bind_call, embedding_names, forward_names
from .ir.signature import Recipe, batch_of, main_input, pad_blocker, seq_input, seq_of
from .ir.plan import ShardingPlan
from .launch.capture_share import capture_for_plan, capture_shared
from .launch import launch_cache
from .launch.launched import LaunchFacts, Launched
from .passes.capture import Captured
from .passes.rewrite import rewrite
from .passes.pipeline import plan_captured, prepare
from .policies import POLICIES, make_policy
from .io.builder import model_from, skeleton
from .runtime.heartbeat import stale_after
from .runtime.heartbeat import start as start_heartbeat
from .io.hf_fill import open_folder
from .runtime.device import bind_user_group, check_model_device, comm_device, init_process_group, rank_device
from .runtime.groups import check_same_rng, plan_groups
from .runtime.timeout import timeout_seconds
from .planning.validate import (Problem, check_batch, check_dims, check_environment, check_example_inputs, check_group,
                       check_min_seq, check_model, check_seq, raise_problems)
from .planning.validate import check_ep

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


def _warn_fallbacks(p: ShardingPlan) -> None:
    fb = p.fallbacks
    if fb:
        rows = "; ".join(f"{n.name} ({n.op}{', ' + n.module if n.module else ''}): {'; '.join(n.notes) or 'gathered'}"
                         for n in fb[:6])
        warn(f"{len(fb)} node(s) have no rule for their input layout and run replicated (exact, "
                      f"gathered first; the plan's fallback rows): {rows}" + (" …" if len(fb) > 6 else ""),
                      AutoshardWarning, stacklevel=3)


def _warn_whole(p: ShardingPlan) -> None:
    """Warn when held-whole weights keep the parameter bytes per rank above the
    mode's ideal (:meth:`~autoshard.ir.plan.ShardingPlan.whole_report`): the user
    would otherwise believe the model split."""
    report = p.whole_report()
    if report:
        warn(f"{report}; the plan's notes say why", AutoshardWarning, stacklevel=3)


def _gc_paused(fn):
    """Run ``fn`` with Python's cyclic garbage collector paused (restored after, as it
    was). Capture, planning and rewriting allocate hundreds of thousands of small
    objects (fx nodes, fake tensors, sympy expressions); each collection then walks the
    whole heap: on a second ``shard()`` in one process (a warm launch after the first
    module) the collector took 40 % of the call. The cycles they leave are collected
    at the collector's next run after the call."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return paused


@quiet_on_other_ranks
@_gc_paused
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

    Dropout runs as the model has it (train mode, its own probabilities), with masks
    drawn from the default generator, which must be in the same state on every rank
    (``seed=s`` calls ``torch.manual_seed(s)`` on every rank; otherwise ``shard()``
    checks it and raises if the ranks differ). ``dropout="sharded"`` (default):
    replicas of a value draw one mask, different slices independent ones.
    ``dropout="dense"``: every dropout draws the mask of the whole tensor and keeps
    its slice, so the run equals a dense run seeded alike (on CPU; a check, slower).

    ``sequence_parallel=True`` (with ``mode="1d"``; the same as ``mode="1d-sp"``)
    splits the activations between the tensor-parallel blocks on the sequence
    (residual stream, norms, dropout: ``1/tp`` of the memory), with an all-gather
    before each column-parallel block and a reduce-scatter after each row-parallel
    one in place of the all-reduce (:mod:`autoshard.policies.one_d_sp`); a call's
    sequence length must divide ``tp``.

    ``device``: where this rank's slices go (default: ``cuda:LOCAL_RANK`` under NCCL,
    the CPU under gloo; :mod:`autoshard.runtime.device`). The model may stay on the CPU
    (or meta, with ``weights=``): only the slices reach the device, and every graph
    literal and constant follows them; calls move their inputs there.

    ``fsdp=True`` (with ``dp > 1``) hands the module to torch's FSDP2 over the ``dp``
    axis (:mod:`autoshard.runtime.fsdp`): each rank keeps ``1/dp`` of its TP block of
    every parameter at rest (dense / (tp·dp) bytes); build the optimizer afterwards.

    ``cp=C`` (context parallelism) splits each replica's sequence ``C`` ways as well:
    world = dp × cp × the mode's mesh. Activations, norms and MLPs hold ``S/C`` tokens;
    attention keeps its queries split and gathers the keys and values over ``cp``
    (or sends them around the ring, below); the loss is the global token mean. A
    call's sequence length must be a multiple of ``cp`` (docs/design.md, "Context parallelism").
    ``cp_attention="ring"`` (default) keeps keys and values split too: their blocks travel
    around the cp ring (send/recv) and the partial results merge through their
    log-sum-exp, so no rank holds the whole keys and values; ``"gather"`` all-gathers them;
    ``"auto"`` plans both and keeps the one the cost model predicts faster on ``cluster``
    (default: this machine's), ring on a tie (it saves less).
    ``cp_order="balanced"`` (default) cuts the sequence into ``2·C`` chunks and gives rank
    ``r`` chunks ``r`` and ``2C-1-r``: ring attention skips the blocks a mask hides, and
    under a causal mask every rank then computes as many (the sequence must be a multiple
    of ``2·C``); ``"contiguous"`` gives rank ``r`` block ``r`` (a multiple of ``C``).

    ``ep=E`` (expert parallelism; ``mode="1d"``, ``E = dp × cp``) spreads each
    mixture-of-experts layer's experts over the data-parallel (and context-parallel) ranks:
    each rank holds ``num_experts / E`` of them (split over ``tp`` as in 1d), its token
    rows travel to their experts' ranks and back by all-to-all (dropless), and the
    experts' gradients are summed by that exchange instead of a dp all-reduce
    (docs/design.md, "Expert parallelism").

    ``pp=P`` (pipeline parallelism, outermost: world = pp × dp × cp × the mode's mesh) cuts
    the graph between transformer blocks into ``P`` stages (``2·P`` for the ``"interleaved"``
    and ``"zbv"`` schedules), each the mode's sharded graph for its layers, run by
    ``torch.distributed.pipelining`` with ``schedule`` (``"1f1b"`` default, ``"gpipe"``,
    ``"interleaved"``, ``"zbv"``); returns a
    :class:`~autoshard.pipeline_parallel.PipelinedModule`, trained with
    :func:`autoshard.training.train.train_step` (docs/design.md, "Pipeline parallelism").

    Example (under ``torchrun --nproc-per-node 2``)::

        sharded = autoshard.shard(model, mode="1d")
        out = sharded(input_ids=ids, labels=ids.clone())
        out.loss.backward()
    """
    mode = _sp_mode(mode, sequence_parallel, "autoshard.shard")
    if pp != 1 or schedule is not None:     # pipeline stages: autoshard.pipeline_parallel
        from .pipeline_parallel import shard_pipelined

        if ep != 1:
            raise ConfigError(f"ep={ep} with pp={pp}: expert parallelism does not compose with pipeline stages yet; "
                              f"choose ep=1 with pp>1, or pp=1 with ep>1")

        if seed is not None:
            torch.manual_seed(seed)
        return shard_pipelined(model, mode=mode, pp=pp, schedule=schedule, depth=depth, dp=dp,
                               example_inputs=example_inputs, gather_logits=gather_logits, dropout=dropout,
                               device=device, cp=cp, cp_attention=cp_attention, cp_order=cp_order, cluster=cluster,
                               ensure_dist=_ensure_dist, fsdp=fsdp, activation_checkpointing=activation_checkpointing,
                               weights=weights, captured=captured)
    if fsdp and dp < 2:
        raise ConfigError(f"fsdp=True shards the parameters over the data-parallel replicas: it needs dp >= 2, "
                          f"got dp={dp}")
    if isinstance(model, (str, os.PathLike)):
        if weights is not None:
            raise ConfigError("shard(path) reads the weights from the folder: pass weights= only with a model")
        src = open_folder(model, train=True)
        sharded = shard(src.model, mode=mode, depth=depth, dp=dp, example_inputs=example_inputs,
                        gather_logits=gather_logits, weights=src.fill, cluster=cluster, debug=debug,
                        activation_checkpointing=activation_checkpointing, dropout=dropout, seed=seed,
                        device=device, fsdp=fsdp, cp=cp, cp_attention=cp_attention, cp_order=cp_order, ep=ep)
        sharded.config, sharded.load_stats = src.config, src.stats
        return sharded.eval()       # as transformers' from_pretrained returns it; .train() turns dropout on
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"shard() takes a torch.nn.Module (e.g. a transformers model) or the path of a local "
                          f"Hugging Face folder (config.json + safetensors), got {type(model).__name__}"
                          + (f" {model!r}" if isinstance(model, (int, float, bytes)) else ""))
    raise_problems(check_ep(ep, mode=mode, dp=dp, cp=cp, fsdp=fsdp), "autoshard.shard")   # before any collective
    model, adapters = unwrap(model)     # a peft wrapper: its injected model (autoshard.adapters)
    if isinstance(example_inputs, (tuple, list)):       # positional, as the model is called
        example_inputs = bind_call(forward_names(model), tuple(example_inputs), {}, "example_inputs")
    stale_after()           # a bad AUTOSHARD_HEARTBEAT is refused before any collective
    _ensure_dist()
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device(device) if device is not None else rank_device()
    check_model_device(model, device)
    check_dropout_mode(dropout)
    if seed is not None:
        torch.manual_seed(seed)
    pol, problems = validate(model, mode=mode, world_size=world, depth=depth, dp=dp, example_inputs=example_inputs,
                             weights_given=weights is not None, environ=os.environ, cp=cp,
                             cp_attention=cp_attention, cp_order=cp_order)
    raise_problems(problems, f"autoshard.shard(mode={mode!r}) on {world} ranks")
    if ep > 1:          # the experts over the dp (× cp) ranks: planned by passes.experts.plan_expert_parallel
        pol.ep = ep
    search_with = None      # mode="auto": what the layout is searched with
    if mode == "auto":      # the layout is the search's: the key names what it searches with
        from .planning.cost import Cluster, default_cluster

        search_with = dict(cluster=Cluster.preset(cluster) if cluster is not None else default_cluster(),
                           depth=depth, dp=dp, cp=cp, cp_attention=cp_attention, cp_order=cp_order)
        layout = dict(policy="auto", cluster=repr(search_with["cluster"]), depth=depth, dp=dp,
                      **({"cp": cp, "cp_attention": cp_attention, "cp_order": cp_order} if cp > 1 else {}))
    else:
        layout = dict(policy=type(pol).__qualname__, mesh=(pol.mesh.axes, pol.mesh.sizes),
                      **({"cp_attention": pol.cp_attention, "cp_order": pol.cp_order} if pol.cp > 1 else {}))
    key = None if captured is not None or ep > 1 else _launch_key(model, example_inputs, world, rank, gather_logits=gather_logits,
                                                         dropout=dropout, **layout)
    entry = None if captured is not None else _launch_entry(key, model)     # every rank passes captured= alike
    if entry is not None:       # every rank has its own: no capture, no search, no planning, no rewrite
        launched = _relaunch(entry, model, pol, mode=mode, example_inputs=example_inputs, rank=rank, world=world)
    else:
        launched = _launch_full(model, captured or capture_shared(model, example_inputs=example_inputs), pol,
                                search_with=search_with, example_inputs=example_inputs,
                                gather_logits=gather_logits, dropout=dropout, rank=rank, world=world, cluster=cluster)
        if key is not None:
            launch_cache.store(key, launched.gm, launched.plan, launched.groups, launched.facts.to_dict())
    # with fsdp the blocks are checkpointed as the FSDP units they become (fully_shard_dp), not outlined here
    out = _finish(model, launched, rank=rank, weights=weights, debug=debug,
                  activation_checkpointing=activation_checkpointing and not fsdp, gather_logits=gather_logits,
                  dropout=dropout, adapters=adapters).place(device)
    if fsdp:
        from .runtime.fsdp import fully_shard_dp
        fully_shard_dp(out, checkpoint=activation_checkpointing)
    return out


def _relaunch(entry, model, pol, *, mode: str, example_inputs, rank: int, world: int) -> Launched:
    """The launch rebuilt from this rank's launch-cache ``entry`` (``pol``: the policy
    asked for; ``mode="auto"``: the one the entry names)."""
    p = entry.plan
    facts = LaunchFacts.from_dict(entry.facts)
    if mode == "auto":
        pol = POLICIES[facts.mode](p.mesh)
        _report_auto(model, pol, example_inputs, world)
    if p.mesh.cp > 1:       # what was planned (an "auto" attention chosen, a searched layout's order)
        pol.cp_attention, pol.cp_order = p.cp_attention, p.cp_order
    groups = _setup_groups(p, rank, world)
    return Launched(gm=launch_cache.rebuild(entry, model, rank, groups), plan=p, policy=pol, groups=groups,
                    facts=facts, from_cache=True)


def _launch_full(model, cap: Captured, pol, *, search_with: dict | None, example_inputs, gather_logits: bool,
                 dropout: str, rank: int, world: int, cluster=None) -> Launched:
    """The launch the whole way: ``cap`` planned under ``pol`` (``search_with``: the
    cluster, depth and dp ``mode="auto"`` searches the layout with instead) and
    rewritten for this rank."""
    if search_with is not None:     # deterministic: every rank picks the same candidate
        from .planning.search import search

        ex = cap.example_inputs
        pol = search(cap, world_size=world, batch_size=batch_of(ex) * search_with["dp"],
                     seq_len=seq_of(ex) or 1, **search_with).best.candidate.policy()
        _report_auto(model, pol, example_inputs, world)
    cap = prepare(cap, pol)     # the vocabulary padded to the split: plan and rewrite the same module
    ex = cap.example_inputs
    main, seq = main_input(ex), seq_input(ex)
    blocker = pad_blocker(cap.module, cap.batch_symbol)
    split, label = pol.batch_split()
    b, s = batch_of(ex), seq_of(ex)
    if b % split and blocker is not None:
        raise_problems(check_batch(b, split, f"{label}; padding the batch would not be exact: {blocker}",
                                   source=f"example_inputs[{main!r}]"), f"autoshard.shard(mode={pol.name!r})")
    if s is not None:
        raise_problems(check_seq(s, pol.seq_split(), source=f"example_inputs[{seq!r}]", why=pol.seq_split_why()),
                       f"autoshard.shard(mode={pol.name!r})")
    s = s or 1              # no token sequence (an image or audio model): nothing scales with it
    if cap.batch_symbol is not None:    # a static batch is kept whole (its rows are never split)
        b += -b % split     # an example batch that does not divide plans as its padded size
    if pol.cp > 1 and pol.cp_attention == "auto":       # the cost model picks ring or gathered keys and values
        from .planning.cost import Cluster, default_cluster
        from .planning.search import choose_cp_attention

        pol = choose_cp_attention(cap, pol, batch_size=b * pol.dp, seq_len=s, dropout=dropout,
                                  cluster=Cluster.preset(cluster) if cluster is not None else default_cluster())[0]
    # each dp replica holds its own rows: the plan reasons on the global batch
    p = plan_captured(cap, pol, batch_size=b * pol.dp, seq_len=s,
                      gather_outputs=gather_logits, dropout=dropout, frozen=_frozen(model))
    groups = _setup_groups(p, rank, world)
    gm = rewrite(cap.module, p, rank=rank, groups=groups)
    facts = LaunchFacts.of_capture(cap, gm, mode=pol.name, batch_size=b * pol.dp, seq_len=s)
    return Launched(gm=gm, plan=p, policy=pol, groups=groups, facts=facts)


def _frozen(model) -> frozenset[str]:
    """Names of ``model``'s parameters with ``requires_grad=False`` (the plan's frozen ones:
    a capture, shared or cached, may come from a model frozen otherwise)."""
    return frozenset(n for n, t in model.named_parameters(remove_duplicate=False) if not t.requires_grad)


def _report_auto(model, pol, example_inputs, world: int) -> None:
    """What the layout ``mode="auto"`` chose leaves whole (warnings: the search chose it
    knowing its fallbacks), and the example inputs' problems."""
    auto = [Problem(x.what, x.message, error=False) for x in check_dims(getattr(model, "config", None), pol)]
    raise_problems(auto + check_example_inputs(example_inputs),
                   f"autoshard.shard(mode='auto' -> {pol.name!r}) on {world} ranks")


def _launch_key(model, example_inputs, world: int, rank: int, **options) -> str | None:
    """The key of this rank's :mod:`autoshard.launch.launch_cache` entry (None where the cache is off):
    ``options`` name the layout (a policy and its mesh, or ``"auto"`` and what it searches
    with) and the shard() options the graph depends on."""
    from .launch.capture_share import cache_key

    if not launch_cache.enabled():
        return None
    return launch_cache.launch_key(cache_key(model, example_inputs), world=world, rank=rank, **options)


def _launch_entry(key: str | None, model):
    """This rank's launch-cache entry, where every rank has its own and it fits the
    model (one all-reduce of a flag: the ranks take the same path either way); else None."""
    entry = launch_cache.read(key) if key is not None else None
    if entry is not None and not launch_cache.fits(entry, model):
        entry = None
    if dist.get_world_size() > 1:
        flag = torch.tensor([0 if entry is None else 1], dtype=torch.int64, device=comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag) == 0:
            return None
    return entry


def _setup_groups(p: ShardingPlan, rank: int, world: int) -> dict:
    """Checks on the plan every rank makes alike, then its process groups."""
    if any(isinstance(n.kernel, Dropout) for n in p.nodes):
        check_same_rng(world, "the model has dropout", "replicas would drop different elements",
                       "before shard(), or shard(..., seed=s)")
    _warn_fallbacks(p)
    _warn_whole(p)
    _warn_placement(p.mesh, world)
    return plan_groups(p, rank)


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


def _sp_mode(mode: str, sequence_parallel: bool, where: str) -> str:
    """``mode`` with ``sequence_parallel`` folded in (1d + sequence parallelism is ``"1d-sp"``)."""
    if not sequence_parallel:
        return mode
    if mode in ("1d", "1d-sp"):
        return "1d-sp"
    raise ConfigError(f"{where}(mode={mode!r}, sequence_parallel=True): sequence parallelism is a 1d layout; "
                      f"valid choices: mode='1d' (or mode='1d-sp'), or sequence_parallel=False")


def _warn_placement(mesh, world: int) -> None:
    """Ranks fill nodes in order (torchrun's LOCAL_WORLD_SIZE per node), so the outer mesh
    axes (dp, then 2.5d's depth) go across nodes; warn when a tensor-parallel axis, whose
    collectives run in every layer, has to cross nodes too."""
    lws = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if not lws or lws >= world or world % lws:
        return
    cross = [a for a, c in mesh.across_nodes(lws).items() if c and a not in ("dp", "dep")]
    if cross:
        warn(f"the {', '.join(cross)} groups of mesh {mesh} span nodes ({world // lws} nodes of {lws} ranks): their "
             f"per-layer collectives run between nodes; use a tensor-parallel size that fits in a node and put "
             f"dp (or 2.5d depth) across nodes", AutoshardWarning, stacklevel=3)


def _plans_at(cap, pol, batch_size: int, seq_len: int, dropout: str) -> bool:
    """Whether ``cap`` plans at ``seq_len`` (a failure at a longer one then blames the length)."""
    try:
        plan_captured(cap, pol, batch_size=batch_size, seq_len=seq_len, dropout=dropout)
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


@_gc_paused
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
    (cp > 1 pins it). ``sequence_parallel=True`` with ``mode="1d"`` is ``mode="1d-sp"``
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
    mode = _sp_mode(mode, sequence_parallel, "autoshard.ir.plan")
    if pp != 1 or schedule is not None:     # pipeline stages: a PipelinePlan (autoshard.pipeline_parallel)
        from .pipeline_parallel import plan_pipeline

        if ep != 1:
            raise ConfigError(f"ep={ep} with pp={pp}: expert parallelism does not compose with pipeline stages yet; "
                              f"choose ep=1 with pp>1, or pp=1 with ep>1")

        return plan_pipeline(model_or_config, world_size=world_size, mode=mode, pp=pp, schedule=schedule,
                             depth=depth, dp=dp, batch_size=batch_size, seq_len=seq_len, micro_batches=micro_batches,
                             cluster=cluster or "dgx-a100", example_inputs=example_inputs, dropout=dropout)
    if step is not None:
        from .io.builder import model_from as _model_from
        from .generate import LEN_QUANTUM, plan_step

        # the model's own plan fixes the parameter layouts the step keeps; they do not depend on the
        # sequence length, so a short one plans it (a long one may pass the model's maximum positions)
        held = plan(model_or_config, world_size=world_size, mode=mode, depth=depth, dp=dp, batch_size=batch_size,
                    seq_len=min(seq_len, 128), example_inputs=example_inputs, cluster=cluster, dropout=dropout)
        pol = make_policy(held.mode, held.mesh.world_size,           # the layout chosen (auto: searched)
                          held.mesh.size("dep") if "dep" in held.mesh.axes else None, held.dp)
        length = max_len or -(-seq_len // LEN_QUANTUM) * LEN_QUANTUM
        return plan_step(_model_from(model_or_config), pol, held, step=step, max_len=length, batch=batch_size)
    if mode == "auto":
        from .planning.search import search

        return search(model_or_config, world_size=world_size, cluster=cluster or "dgx-a100", depth=depth,
                      dp=dp if dp != 1 else None, batch_size=batch_size, seq_len=seq_len,
                      example_inputs=example_inputs, cp=cp if cp != 1 else None, cp_attention=cp_attention,
                      cp_order=cp_order).plan
    raise_problems(check_ep(ep, mode=mode, dp=dp, cp=cp), "autoshard.plan")
    pol = make_policy(mode, world_size, depth, dp, cp, cp_attention, cp_order)
    pol.ep = ep             # expert parallelism (see shard()): the plan shows its all-to-alls
    split, label = pol.batch_split()
    if pol.dp > 1:          # the plan's batch is the global one: dp replicas cut it first
        split, label = split * pol.dp, f"dp[{pol.dp}]" + (f" × {label}" if label else "")
    raise_problems(check_batch(batch_size, split, label, source="batch_size")
                   + check_seq(seq_len, pol.seq_split(), source="seq_len", why=pol.seq_split_why()), f"autoshard.plan(mode={mode!r})")
    model = model_from(model_or_config)
    model.train()
    cap = capture_for_plan(model, example_inputs=example_inputs)
    try:
        if pol.cp > 1 and pol.cp_attention == "auto":   # the cost model picks ring or gathered keys and values
            from .planning.search import choose_cp_attention

            planned = choose_cp_attention(cap, pol, batch_size=batch_size, seq_len=seq_len, dropout=dropout,
                                          cluster=cluster or "dgx-a100")[1]
        else:
            planned = plan_captured(cap, pol, batch_size=batch_size, seq_len=seq_len, dropout=dropout)
        raise_problems(check_min_seq(seq_len, planned, source="seq_len"), f"autoshard.plan(mode={mode!r})")
        return planned
    except ShardingError as e:
        name, most = _input_limits(getattr(model, "config", None)).get("max_positions", ("", seq_len))
        if seq_len > most and _plans_at(cap, pol, batch_size, most, dropout):
            # a learned-position table shorter than the planned sequence: the model plans at its maximum
            raise ConfigError(f"autoshard.plan: seq_len={seq_len} is longer than the model's {name}={most}; "
                              f"plan with seq_len <= {most} (planning failed at: {str(e).splitlines()[0]})") from e
        raise
