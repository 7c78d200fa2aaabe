"""What one launch is asked for: :class:`ShardConfig`, built once from the keywords of
:func:`autoshard.shard` and :func:`autoshard.plan` and checked there.

The keywords stay as users write them (``shard(model, mode="1d", sequence_parallel=True,
dp=2)``); the entry point turns them into one frozen record at its first line
(:meth:`ShardConfig.of`), and everything after it (the launch pipeline,
:mod:`autoshard.launch.pipeline`; the launch cache's key; the pipeline-parallel launch)
reads the record, never the keywords again. ``sequence_parallel`` is folded into the
mode, the checks that need no model and no process group run here (a bad choice raises a
:class:`~autoshard.ir.errors.ConfigError` naming the valid ones, before any collective),
and where ``mode="auto"`` or ``cp_attention="auto"`` is searched with a cluster the one
default is decided by :meth:`ShardConfig.search_cluster` (docs/design.md, "Launch pipeline").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .ir.errors import ConfigError
from .ir.kernels import check_dropout_mode
from .planning.validate import check_ep, raise_problems

__all__ = ["ShardConfig", "fold_sequence_parallel"]

# what each entry point searches ``mode="auto"`` / ``cp_attention="auto"`` on when no cluster
# is named: shard() runs on this machine (a guess from its device), plan() plans for a
# cluster it does not run on (the common training box)
_DEFAULT_CLUSTER = {"shard": None, "plan": "dgx-a100"}


def fold_sequence_parallel(mode: str, sequence_parallel: bool, where: str) -> str:
    """``mode`` with ``sequence_parallel`` folded in (1d + sequence parallelism is ``"1d-sp"``).

    >>> fold_sequence_parallel("1d", True, "autoshard.shard")
    '1d-sp'
    >>> fold_sequence_parallel("2d", True, "autoshard.shard")
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.ConfigError: autoshard.shard(mode='2d', sequence_parallel=True): sequence parallelism is a 1d layout; valid choices: mode='1d' (or mode='1d-sp'), or sequence_parallel=False
    """
    if not sequence_parallel:
        return mode
    if mode in ("1d", "1d-sp"):
        return "1d-sp"
    raise ConfigError(f"{where}(mode={mode!r}, sequence_parallel=True): sequence parallelism is a 1d layout; "
                      f"valid choices: mode='1d' (or mode='1d-sp'), or sequence_parallel=False")


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """One launch's options, frozen and checked (``shard()``'s and ``plan()``'s keywords).

    Attributes:
        entry: ``"shard"`` or ``"plan"`` (which entry point built it: its default cluster).
        mode: the layout (``"1d"``, ``"1d-sp"``, ``"2d"``, ``"2.5d"``, ``"3d"``) or
            ``"auto"`` (searched); ``sequence_parallel=True`` is already folded in.
        depth: 2.5d's depth (None: the mode's default).
        dp, cp, ep, pp: data-, context-, expert- and pipeline-parallel sizes.
        cp_attention: ``"ring"``, ``"gather"`` or ``"auto"`` (chosen by the cost model).
        cp_order: ``"balanced"`` or ``"contiguous"``.
        schedule: the pipeline schedule (None: ``"1f1b"`` where ``pp > 1``).
        dropout: ``"sharded"`` or ``"dense"`` (:data:`autoshard.ir.kernels.DROPOUT_MODES`).
        gather_logits: whether the outputs come back whole on every rank.
        activation_checkpointing: recompute each repeated block in backward.
        fsdp: hand the module to FSDP2 over ``dp``.
        device: where this rank's slices go (None: the rank's device).
        cluster: the cluster the search prices on (a preset name or a Cluster; None: the
            entry point's default, :meth:`search_cluster`).
        debug: check each call's inputs agree across the ranks of a replica.
        seed: ``torch.manual_seed(seed)`` on every rank before the launch.

    What the options do (as :func:`autoshard.shard` takes them):

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
    each rank holds ``ceil(num_experts / E)`` of them (zero-padded experts, never routed to, where
    ``E`` does not divide them; split over ``tp`` as in 1d), its token
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

    Example:
        >>> cfg = ShardConfig.of(mode="1d", sequence_parallel=True, dp=2)
        >>> cfg.mode, cfg.dp, cfg.pipelined
        ('1d-sp', 2, False)
        >>> ShardConfig.of(mode="1d", fsdp=True)
        Traceback (most recent call last):
        ...
        autoshard.ir.errors.ConfigError: fsdp=True shards the parameters over the data-parallel replicas: it needs dp >= 2, got dp=1
    """

    entry: str = "shard"
    mode: str = "auto"
    depth: int | None = None
    dp: int = 1
    cp: int = 1
    cp_attention: str = "ring"
    cp_order: str = "balanced"
    ep: int = 1
    pp: int = 1
    schedule: str | None = None
    dropout: str = "sharded"
    gather_logits: bool = True
    activation_checkpointing: bool = False
    fsdp: bool = False
    device: object = None
    cluster: object = None
    debug: bool = False
    seed: int | None = None

    @classmethod
    def of(cls, *, sequence_parallel: bool = False, **options) -> "ShardConfig":
        """The config of ``options`` (the entry point's keywords, ``sequence_parallel``
        folded into the mode), checked: raises :class:`~autoshard.ir.errors.ConfigError`
        naming the valid choices, before any collective."""
        entry = options.get("entry", "shard")
        where = "autoshard.shard" if entry == "shard" else "autoshard.plan"
        options["mode"] = fold_sequence_parallel(options.get("mode", "auto"), sequence_parallel,
                                                 where if entry == "shard" else "autoshard.ir.plan")
        cfg = cls(**options)
        cfg._check(where)
        return cfg

    def _check(self, where: str) -> None:
        check_dropout_mode(self.dropout)
        if self.pipelined:
            if self.ep != 1:
                raise ConfigError(f"ep={self.ep} with pp={self.pp}: expert parallelism does not compose with "
                                  f"pipeline stages yet; choose ep=1 with pp>1, or pp=1 with ep>1")
            return
        if self.fsdp and self.dp < 2:
            raise ConfigError(f"fsdp=True shards the parameters over the data-parallel replicas: it needs dp >= 2, "
                              f"got dp={self.dp}")
        raise_problems(check_ep(self.ep, mode=self.mode, dp=self.dp, cp=self.cp, fsdp=self.fsdp), where)

    @property
    def pipelined(self) -> bool:
        """Whether the launch cuts pipeline stages (``pp > 1`` or a schedule named)."""
        return self.pp != 1 or self.schedule is not None

    def replace(self, **changes) -> "ShardConfig":
        """A copy with ``changes`` (a resolved mode, a path's weights callback, ...)."""
        return dataclasses.replace(self, **changes)

    def search_cluster(self):
        """What ``mode="auto"`` and ``cp_attention="auto"`` are priced on: the cluster named,
        else the entry point's default (``shard()``: guessed from this process's device,
        :func:`autoshard.planning.cost.default_cluster`; ``plan()``: ``"dgx-a100"``). The one
        place that default is decided."""
        if self.entry == "plan":
            return self.cluster or _DEFAULT_CLUSTER["plan"]
        from .planning.cost import Cluster, default_cluster

        return Cluster.preset(self.cluster) if self.cluster is not None else default_cluster()

    def resolved(self, policy) -> "ShardConfig":
        """The concrete config of the layout ``policy`` (what ``"auto"`` chose): its mode,
        mesh sizes and context-parallel options."""
        mesh = policy.mesh
        return self.replace(mode=policy.name, depth=mesh.size("dep") if "dep" in mesh.axes else None,
                            dp=policy.dp, cp=policy.cp, cp_attention=policy.cp_attention, cp_order=policy.cp_order)

    def policy(self, world_size: int):
        """The policy of this (concrete) config on ``world_size`` ranks, with its expert split."""
        from .policies import make_policy

        pol = make_policy(self.mode, world_size, self.depth, self.dp, self.cp, self.cp_attention, self.cp_order)
        if self.ep > 1:
            pol.ep = self.ep
        return pol
