"""The launch pipeline: one object whose named stages take a model to a rank's rewritten graph.

``capture → prepare → plan → groups → rewrite → place``: every entry point runs it, or the
stages it needs (docs/design.md, "Launch pipeline"): :func:`autoshard.shard` all of them
(through the launch cache's memo, :meth:`Pipeline.launch`), :func:`autoshard.plan` capture
to plan, a recapture for a new input signature (:mod:`autoshard.launch.recapture`) and
:mod:`autoshard.generate`'s step graphs capture to rewrite, :func:`autoshard.verify` capture
and prepare (the dense values) and plan (the plan the ranks will make), the
pipeline-parallel launch capture to rewrite (then its own cut). No other module outside
``passes/`` (and the search, which plans its candidates) calls the passes they wrap.

Each stage is a :class:`Stage`: one function ``LaunchState -> LaunchState`` that names the
fields it requires and the fields it ensures, checked around the call as torch.fx's
``PassBase`` checks a pass (requires → call → ensures).

Example:
    >>> import torch
    >>> from autoshard.config import ShardConfig
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    >>> st = LaunchState(config=ShardConfig.of(mode="1d", entry="plan"), model=m, world_size=2,
    ...                  example_inputs={"input": torch.randn(4, 8)}, capture_with="plain",
    ...                  batch_size=4, seq_len=1)
    >>> st = PIPELINE.run(st, "capture", "prepare", "plan")
    >>> st.plan.mode, st.plan.mesh.sizes
    ('1d', (2,))
    >>> PIPELINE.run(LaunchState(config=st.config), "plan")
    Traceback (most recent call last):
    ...
    autoshard.launch.pipeline.StageError: stage 'plan' requires prepared, policy; missing: prepared, policy
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..config import ShardConfig
from ..ir.errors import AutoshardError, AutoshardWarning
from ..ir.kernels import Dropout
from ..ir.log import warn
from ..ir.signature import batch_of, main_input, pad_blocker, seq_input, seq_of
from ..passes.capture import capture
from ..passes.pipeline import plan_prepared, prepare
from ..passes.rewrite import rewrite
from ..planning.validate import Problem, check_batch, check_dims, check_example_inputs, check_seq, raise_problems
from ..runtime.device import comm_device
from ..runtime.groups import check_same_rng, plan_groups
from . import launch_cache
from .capture_share import cache_key, capture_cached, capture_for_plan, capture_shared
from .launched import LaunchFacts, Launched

__all__ = ["LaunchState", "Stage", "StageError", "Pipeline", "PIPELINE", "LAUNCH", "launch_key", "launch_shape", "layout_state", "recipe_state"]

LAUNCH = ("capture", "prepare", "plan", "groups", "rewrite")     # a rank's graph; "place" follows the module


class StageError(AutoshardError, ValueError):
    """A stage run without what it requires, or that did not make what it ensures (a bug
    in the caller or the stage, not in the user's input)."""


@dataclass(frozen=True, kw_only=True)
class LaunchState:
    """What the stages read and write: a record, replaced (never mutated) by each stage.

    Attributes:
        config: the launch's :class:`~autoshard.config.ShardConfig` (concrete once
            ``prepare`` resolved ``mode="auto"``).
        model: what ``capture`` exports; example_inputs: its inputs.
        world_size, rank: the layout's ranks (pp: one stage's) and this rank.
        capture_with: ``"shared"`` (rank 0 exports, the others load: collective),
            ``"cached"`` (the disk cache, no process group), ``"for_plan"`` (plan(): a
            stamped capture), ``"plain"`` (:func:`autoshard.passes.capture.capture`).
        capture_fn: the export to run instead of the model's forward (generate's steps).
        captured: the capture; prepared: it as ``policy`` plans it (``prepare``).
        policy: the layout (None with ``mode="auto"``: ``prepare`` searches it).
        vocab, pinned, frozen: :func:`autoshard.passes.pipeline.plan_prepared`'s options
            (``vocab``: :func:`~autoshard.passes.pipeline.prepare`'s).
        batch_size, seq_len: what the plan is made for (None: ``shard()``'s rules on the
            capture's example, :func:`_launch_shape`).
        plan, groups, gm: the plan, this rank's process groups, its rewritten graph.
        group_mesh: the whole mesh the groups are made over (pp: with its ``pp`` axis).
        local_rank: the rank within ``policy``'s mesh the rewrite slices for (pp).
        checks: what ``groups`` checks first: ``"launch"`` (shard(): the dropout RNG and
            the plan's warnings), ``"rng"`` (the dropout RNG), ``"none"``.
        module: the built module ``place`` moves to ``device``.
    """

    config: ShardConfig
    model: torch.nn.Module | None = None
    example_inputs: dict | None = None
    world_size: int = 1
    rank: int = 0
    capture_with: str = "shared"
    capture_fn: Callable | None = None
    captured: object = None
    policy: object = None
    prepared: object = None
    vocab: int | None = None
    pinned: dict | None = None
    frozen: frozenset | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    plan: object = None
    group_mesh: object = None
    local_rank: int | None = None
    checks: str = "none"
    groups: dict | None = None
    gm: object = None
    facts: LaunchFacts | None = None
    module: object = None
    device: object = None

    def but(self, **changes) -> "LaunchState":
        """A copy with ``changes`` (what a stage ensures)."""
        return dataclasses.replace(self, **changes)

    def launched(self, *, from_cache: bool = False) -> Launched:
        """The :class:`~autoshard.launch.launched.Launched` record of a state past ``rewrite``."""
        return Launched(gm=self.gm, plan=self.plan, policy=self.policy, groups=self.groups, facts=self.facts,
                        from_cache=from_cache)


@dataclass(frozen=True)
class Stage:
    """One named stage: ``fn(state) -> state``, run between its checks. A field of
    ``requires`` written ``"a|b"`` needs either."""

    name: str
    fn: Callable[[LaunchState], LaunchState]
    requires: tuple = ()
    ensures: tuple = ()

    def __call__(self, state: LaunchState) -> LaunchState:
        missing = [f for f in self.requires if all(getattr(state, a) is None for a in f.split("|"))]
        if missing:
            raise StageError(f"stage {self.name!r} requires {', '.join(self.requires)}; missing: {', '.join(missing)}")
        out = self.fn(state)
        lost = [f for f in self.ensures if getattr(out, f) is None]
        if lost:
            raise StageError(f"stage {self.name!r} ensures {', '.join(self.ensures)}; it left {', '.join(lost)} unset")
        return out


# ------------------------------------------------------------------ the stages

def _capture(state: LaunchState) -> LaunchState:
    """The model exported for its example inputs (a capture already given is kept)."""
    if state.captured is not None:
        return state
    if state.capture_with == "plain":
        return state.but(captured=capture(state.model, example_inputs=state.example_inputs))
    kw = {"capture_fn": state.capture_fn} if state.capture_fn is not None else {}
    how = {"shared": capture_shared, "cached": capture_cached, "for_plan": capture_for_plan}[state.capture_with]
    return state.but(captured=how(state.model, example_inputs=state.example_inputs, **kw))


def _prepare(state: LaunchState) -> LaunchState:
    """The layout (``mode="auto"``: searched on the capture, the same on every rank) and the
    capture as it plans (:func:`autoshard.passes.pipeline.prepare`: run once per launch)."""
    pol, config = state.policy, state.config
    if pol is None and config.mode == "auto":
        pol = _search_layout(state)
        if state.checks == "launch":
            _report_auto(state.model, pol, state.example_inputs, state.world_size)
        config = config.resolved(pol)
    elif pol is None:
        pol = config.policy(state.world_size)
    return state.but(policy=pol, config=config, prepared=prepare(state.captured, pol, vocab=state.vocab))


def _plan(state: LaunchState) -> LaunchState:
    """The plan of the prepared capture (``cp_attention="auto"``: chosen first by the cost
    model) for ``batch_size`` and ``seq_len`` (None: :func:`launch_shape`'s)."""
    if state.batch_size is None:        # shard(): from the capture's example
        state = launch_shape(state)
    pol, p = state.policy, None
    if pol.cp > 1 and pol.cp_attention == "auto":
        from ..planning.search import choose_cp_attention

        pol, chosen = choose_cp_attention(state.prepared, pol, batch_size=state.batch_size, seq_len=state.seq_len,
                                          dropout=state.config.dropout, cluster=state.config.search_cluster())
        if state.pinned is None and state.frozen is None and state.config.gather_logits:
            p = chosen      # planned with these very options (plan()): not planned a second time
    if p is None:
        p = plan_prepared(state.prepared, pol, batch_size=state.batch_size, seq_len=state.seq_len,
                          gather_outputs=state.config.gather_logits, dropout=state.config.dropout,
                          pinned=state.pinned, frozen=state.frozen)
    return state.but(policy=pol, config=state.config.resolved(pol), plan=p)


def _groups(state: LaunchState) -> LaunchState:
    """The checks every rank makes alike on the plan, then its process groups (collective)."""
    p = state.plan
    if state.checks != "none" and any(isinstance(n.kernel, Dropout) for n in p.nodes):
        check_same_rng(dist.get_world_size(), "the model has dropout", "replicas would drop different elements",
                       "before shard(), or shard(..., seed=s)")
    if state.checks == "launch":
        _warn_plan(p, dist.get_world_size())
    return state.but(groups=plan_groups(p, state.rank, mesh=state.group_mesh))


def _rewrite(state: LaunchState) -> LaunchState:
    """This rank's graph: the prepared capture rewritten under the plan, its facts."""
    rank = state.rank if state.local_rank is None else state.local_rank
    gm = rewrite(state.prepared.module, state.plan, rank=rank, groups=state.groups)
    facts = LaunchFacts.of_capture(state.prepared, gm, mode=state.policy.name, batch_size=state.batch_size,
                                   seq_len=state.seq_len)
    return state.but(gm=gm, facts=facts)


def _place(state: LaunchState) -> LaunchState:
    """The built module's slices, constants and buffers moved to the rank's device."""
    return state.but(module=state.module.place(state.device))


class Pipeline:
    """The named stages, run in order (:meth:`run`) or through the launch cache (:meth:`launch`)."""

    def __init__(self, stages: tuple[Stage, ...]):
        self.stages = {s.name: s for s in stages}

    def run(self, state: LaunchState, *names: str) -> LaunchState:
        """``state`` through the stages ``names`` (default :data:`LAUNCH`), in the order given."""
        for name in names or LAUNCH:
            state = self.stages[name](state)
        return state

    def launch(self, state: LaunchState, key: str | None) -> Launched:
        """A rank's launch (:data:`LAUNCH`) memoised by the launch cache under ``key``
        (:meth:`key`; None: not cached): where every rank has an entry that fits the model,
        its rewritten graph is rebuilt from it (no capture, search, plan or rewrite), else
        the stages run and their result is stored."""
        # a capture given: every rank passes one alike, and nothing is cached (no flag to agree on)
        entry = _entry(key, state.model) if state.captured is None else None
        if entry is not None:
            return self._relaunch(entry, state)
        state = self.run(state)
        if key is not None:
            launch_cache.store(key, state.gm, state.plan, state.groups, state.facts.to_dict())
        return state.launched()

    @staticmethod
    def key(state: LaunchState) -> str | None:
        """The launch-cache key of ``state`` (None where the cache is off or cannot hold the
        launch: a capture given, experts split): the model and inputs, and the config by what the
        graph depends on (a concrete layout; ``mode="auto"``: what it is searched with)."""
        cfg = state.config
        if state.captured is not None or cfg.ep > 1 or not launch_cache.enabled():
            return None
        cp_opts = {"cp": cfg.cp, "cp_attention": cfg.cp_attention, "cp_order": cfg.cp_order}
        if cfg.mode == "auto":
            layout = dict(policy="auto", cluster=repr(cfg.search_cluster()), depth=cfg.depth, dp=cfg.dp,
                          **(cp_opts if cfg.cp > 1 else {}))
        else:
            pol = state.policy
            layout = dict(policy=type(pol).__qualname__, mesh=(pol.mesh.axes, pol.mesh.sizes),
                          **({"cp_attention": pol.cp_attention, "cp_order": pol.cp_order} if pol.cp > 1 else {}))
        return launch_key(state.model, state.example_inputs, state.world_size, state.rank,
                          gather_logits=cfg.gather_logits, dropout=cfg.dropout, **layout)

    def _relaunch(self, entry, state: LaunchState) -> Launched:
        """The launch rebuilt from this rank's cache ``entry`` (``mode="auto"``: the layout
        the entry names), through the ``groups`` stage like a first launch."""
        from ..policies import POLICIES

        p, pol = entry.plan, state.policy
        facts = LaunchFacts.from_dict(entry.facts)
        if state.config.mode == "auto":
            pol = POLICIES[facts.mode](p.mesh)
            _report_auto(state.model, pol, state.example_inputs, state.world_size)
        if p.mesh.cp > 1:       # what was planned (an "auto" attention chosen, a searched layout's order)
            pol.cp_attention, pol.cp_order = p.cp_attention, p.cp_order
        state = self.run(state.but(plan=p, policy=pol, facts=facts), "groups")
        gm = launch_cache.rebuild(entry, state.model, state.rank, state.groups)
        return state.but(gm=gm).launched(from_cache=True)


PIPELINE = Pipeline((
    Stage("capture", _capture, requires=("model|captured",), ensures=("captured",)),
    Stage("prepare", _prepare, requires=("captured",), ensures=("policy", "prepared")),
    Stage("plan", _plan, requires=("prepared", "policy"), ensures=("plan", "batch_size", "seq_len")),
    Stage("groups", _groups, requires=("plan",), ensures=("groups",)),
    Stage("rewrite", _rewrite, requires=("prepared", "plan", "groups"), ensures=("gm", "facts")),
    Stage("place", _place, requires=("module",), ensures=("module",)),
))


# ------------------------------------------------------------------ shard()'s rules around the stages

def layout_state(policy, *, dropout: str = "sharded", gather_outputs: bool = True,
                 activation_checkpointing: bool = False, **fields) -> LaunchState:
    """A first state for a layout already chosen (``policy``), with ``fields`` set: the
    form another graph of a sharded module starts from (generate's step graphs)."""
    cfg = ShardConfig(dropout=dropout, ep=getattr(policy, "ep", 1), gather_logits=gather_outputs,
                      activation_checkpointing=activation_checkpointing).resolved(policy)
    return LaunchState(config=cfg, policy=policy, **fields)


def recipe_state(recipe, **fields) -> LaunchState:
    """:func:`layout_state` of what a sharded module's :class:`~autoshard.ir.signature.Recipe`
    recorded (a recapture for a new input signature)."""
    return layout_state(recipe.policy, dropout=recipe.dropout, gather_outputs=recipe.gather_outputs,
                        activation_checkpointing=recipe.activation_checkpointing, **fields)


def launch_shape(state: LaunchState) -> LaunchState:
    """``state`` with the plan's batch and sequence taken from the prepared capture's example,
    as ``shard()`` plans them: the global batch (dp replicas), a batch the split does not
    divide planned as its padded size (refused where padding would not be exact), a sequence
    checked against the layout's split."""
    pol, cap = state.policy, state.prepared
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
    if cap.batch_symbol is not None:    # a static batch is kept whole (its rows are never split)
        b += -b % split
    # each dp replica holds its own rows: the plan reasons on the global batch; no token
    # sequence (an image or audio model): nothing scales with it
    return state.but(batch_size=b * pol.dp, seq_len=s or 1)


def _search_layout(state: LaunchState):
    """``mode="auto"``'s layout: the search's best on the capture, deterministic (every rank
    picks the same candidate)."""
    from ..planning.search import search

    cfg, ex = state.config, state.captured.example_inputs
    return search(state.captured, world_size=state.world_size, batch_size=batch_of(ex) * cfg.dp,
                  seq_len=seq_of(ex) or 1, cluster=cfg.search_cluster(), depth=cfg.depth, dp=cfg.dp, cp=cfg.cp,
                  cp_attention=cfg.cp_attention, cp_order=cfg.cp_order, ep=cfg.ep).best.candidate.policy()


def _report_auto(model, pol, example_inputs, world: int) -> None:
    """What the layout ``mode="auto"`` chose leaves whole (warnings: the search chose it
    knowing its fallbacks), and the example inputs' problems."""
    auto = [Problem(x.what, x.message, error=False) for x in check_dims(getattr(model, "config", None), pol)]
    raise_problems(auto + check_example_inputs(example_inputs),
                   f"autoshard.shard(mode='auto' -> {pol.name!r}) on {world} ranks")


def launch_key(model, example_inputs, world: int, rank: int, **options) -> str:
    """The key of this rank's :mod:`autoshard.launch.launch_cache` entry: the capture's key
    (model, inputs) and ``options``, the layout (a policy and its mesh, or ``"auto"`` and
    what it searches with) and the shard() options the graph depends on."""
    return launch_cache.launch_key(cache_key(model, example_inputs), world=world, rank=rank, **options)


def _entry(key: str | None, model):
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


def _warn_plan(p, world: int) -> None:
    """The plan's warnings: nodes with no rule (gathered), weights held whole, a
    tensor-parallel axis across nodes."""
    _warn_fallbacks(p)
    _warn_whole(p)
    _warn_placement(p.mesh, world)


def _warn_fallbacks(p) -> None:
    fb = p.fallbacks
    if fb:
        rows = "; ".join(f"{n.name} ({n.op}{', ' + n.module if n.module else ''}): {'; '.join(n.notes) or 'gathered'}"
                         for n in fb[:6])
        warn(f"{len(fb)} node(s) have no rule for their input layout and run replicated (exact, "
             f"gathered first; the plan's fallback rows): {rows}" + (" …" if len(fb) > 6 else ""),
             AutoshardWarning, stacklevel=5)


def _warn_whole(p) -> None:
    """Warn when held-whole weights keep the parameter bytes per rank above the
    mode's ideal (:meth:`~autoshard.ir.plan.ShardingPlan.whole_report`): the user
    would otherwise believe the model split."""
    report = p.whole_report()
    if report:
        warn(f"{report}; the plan's notes say why", AutoshardWarning, stacklevel=5)


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
             f"dp (or 2.5d depth) across nodes", AutoshardWarning, stacklevel=5)
