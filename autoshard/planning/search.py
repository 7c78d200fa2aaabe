"""``mode="auto"``: enumerate every mesh the registered modes accept, plan each
on one captured graph, and rank them by the cost model's predicted step time.

Candidates are every ``(mode, q, d, dp, cp)`` for which the mode's own
``make_mesh(world / cp, depth=, dp=)`` accepts the factorisation (modes come from
:data:`~autoshard.policies.POLICIES`, so a new mode joins the search by being
registered); ``cp`` (context parallelism: the sequence split over a ``cp`` axis) is
searched with ``cp=None``, for the modes that take it, and dropped where the
sequence does not cut into its blocks. A candidate is dropped when its global batch does not split over
its batch axes, when planning fails, or when parameters + gradients + optimizer
state + activations exceed the cluster's memory per rank; the rest are ranked by
predicted step time (ties: less communication, then the registry order). If
nothing fits, the :class:`~autoshard.ir.errors.ConfigError` names the smallest world
size that would.

``batch_size`` is the *global* batch, as in every plan: ``dp`` replicas split it
first, the mode's batch axes split each replica's rows further.

Example:
    >>> from transformers import LlamaConfig
    >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    ...                   num_attention_heads=4, num_key_value_heads=4, vocab_size=128)
    >>> r = search(cfg, world_size=4, cluster="dgx-a100", batch_size=8, seq_len=16)
    >>> r.best.candidate.mode in ("1d", "2d", "2.5d", "3d"), r.plan.mesh.world_size
    (True, 4)
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from .cost import Cluster, CostEstimate, estimate, human_bytes
from ..ir.errors import AutoshardError, ConfigError
from ..ir.mesh import Mesh
from ..ir.plan import ShardingPlan

__all__ = ["Candidate", "Evaluated", "SearchResult", "candidates", "search", "choose_cp_attention"]

_MAX_UPWARD = 1 << 16
#: the row chunk counts of asynchronous TP (:meth:`autoshard.module.ShardedModule.async_tp`) a 1d
#: or 1d-sp candidate is also costed with; the cheapest is kept (``Evaluated.async_tp``)
ASYNC_TP_CHUNKS = (2, 4)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One factorisation of the world size: ``mode`` on ``mesh``.

    ``q`` is the side of the tensor-parallel grid (the TP size for 1d), ``d`` the
    depth (2.5d), ``dp`` the data-parallel replicas; ``depth`` is the value that
    was passed to ``make_mesh`` (None when the mode takes none)."""

    mode: str
    q: int
    d: int
    dp: int
    depth: int | None
    mesh: Mesh
    cp: int = 1
    cp_attention: str = "ring"
    cp_order: str = "balanced"
    ep: int = 1                 # expert parallelism over the dp (× cp) ranks (1: expert-TP)

    @property
    def label(self) -> str:
        from ..policies import POLICIES

        return POLICIES[self.mode].label(self.mesh) + (" · gathered kv" if self.cp > 1 and
                                                        self.cp_attention == "gather" else "") + \
            (f" · ep{self.ep}" if self.ep > 1 else "")

    def policy(self):
        from ..policies import POLICIES

        pol = POLICIES[self.mode](self.mesh)
        if self.cp > 1:
            pol.cp_attention, pol.cp_order = self.cp_attention, self.cp_order
        if self.ep > 1:
            pol.ep = self.ep
        return pol


@dataclass(frozen=True, kw_only=True)
class Evaluated:
    """A candidate with its plan and predicted cost, or the reason it was dropped.

    ``plan`` is None for a candidate priced on a stamped capture's shallow graphs and not
    chosen (:func:`search`): its ``cost`` is the full graph's all the same."""

    candidate: Candidate
    plan: ShardingPlan | None = None
    cost: CostEstimate | None = None
    reason: str = ""
    rank: int | None = None          # 1 = chosen; None = dropped
    async_tp: int = 1                # row chunks that pay (1d; ShardedModule.async_tp), 1: none do
    fallbacks: int = 0               # the plan's fallback nodes (priced: the full graph's count)

    @property
    def ok(self) -> bool:
        return self.rank is not None


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f}" if n >= 2**24 else f"{n / 2**30:.2g}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _describe(mode: str, mesh: Mesh) -> tuple[int, int, int]:
    from ..policies import POLICIES

    q, d = POLICIES[mode].grid(mesh)
    return q, d, mesh.dp


def candidates(world_size: int, *, modes=None, depth: int | None = None, dp: int | None = None,
               cp: int | None = 1, cp_attention: str = "ring", cp_order: str = "balanced",
               ep: int | None = 1) -> list[Candidate]:
    """Every ``(mode, q, d, dp, cp)`` the registered modes accept for ``world_size``.

    ``depth`` / ``dp`` / ``cp`` pin those values (``cp=None``: every cp dividing the world,
    for the modes that take a cp axis); ``modes`` restricts the modes. A mesh with a
    size-1 axis (2.5d with d = 1 is 2d; a 1-rank TP axis) is kept only where it is
    the one way to express the layout: pure data parallelism is ``1d [1] × dp``, pure
    context parallelism ``1d [1] × cp``. ``ep`` pins expert parallelism (above 1: the ``1d``
    candidates whose dp × cp it divides, with that ep); ``ep=None`` adds, beside every ``1d``
    candidate, one per divisor ``E > 1`` of its dp × cp (for a model with experts).

    >>> [c.label for c in candidates(4, dp=2, modes=["1d"], ep=None)]
    ['1d [2] × dp2', '1d [2] × dp2 · ep2']
    >>> [c.label for c in candidates(4)]
    ['1d [4]', '1d [2] × dp2', '1d [1] × dp4', '1d-sp [4]', '1d-sp [2] × dp2', '2d [2,2]']
    >>> [c.label for c in candidates(4, cp=None) if c.cp > 1]
    ['1d [2] × cp2', '1d [1] × cp2 × dp2', '1d [1] × cp4']
    """
    from ..policies import POLICIES, with_cp

    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    names = list(POLICIES) if modes is None else list(modes)
    for m in names:
        if m not in POLICIES:
            raise ConfigError(f"unknown mode {m!r}; valid modes: {', '.join(POLICIES)}")
    out: list[Candidate] = []
    cps = _divisors(world_size) if cp is None else [cp]
    attentions = ("ring", "gather") if cp_attention == "auto" else (cp_attention,)
    for c in cps:
        if world_size % c:
            continue
        for mode, mesh, dd in _meshes(world_size // c, [m for m in names if c == 1 or POLICIES[m].composes_with_cp],
                                      depth, dp):
            mesh = with_cp(mesh, c)
            q, d, rr = _describe(mode, mesh)
            for att in attentions if c > 1 else ("ring",):
                out.append(Candidate(mode=mode, q=q, d=d, dp=rr, depth=dd, mesh=mesh, cp=c, cp_attention=att,
                                     cp_order=cp_order))
    out = _with_ep(out, ep)
    order = {m: i for i, m in enumerate(POLICIES)}
    out.sort(key=lambda c: (c.cp, order[c.mode], c.dp, c.d, c.q, c.cp_attention != "ring", c.ep))
    return out


def _with_ep(cands: list[Candidate], ep: int | None) -> list[Candidate]:
    """``cands`` with expert parallelism (:func:`candidates`' ``ep``): only ``1d`` composes
    with it (docs/design.md, "Expert parallelism"), over its dp × cp ranks."""
    if ep == 1:
        return cands
    out = []
    for c in cands:
        n = c.dp * c.cp
        if ep is None:
            out.append(c)
            out.extend(dataclasses.replace(c, ep=e) for e in _divisors(n)[1:] if c.mode == "1d")
        elif c.mode == "1d" and n % ep == 0:
            out.append(dataclasses.replace(c, ep=ep))
    return out


def choose_cp_attention(cap, pol, *, batch_size: int, seq_len: int, cluster, dropout: str = "sharded",
                        optimizer: str | None = "adamw"):
    """``(policy, plan)`` for ``pol`` with ``cp_attention="auto"`` resolved by the cost model:
    ring attention and gathered keys and values planned on ``cap``, the one whose plan fits
    ``cluster`` and is predicted faster kept (a tie: the ring, which saves less). The ring
    sends more in backward (each block, then its key/value gradients: ``2C-1`` steps of
    ``k+v`` against the reduce-scatter's ``C-1``), the gathered form saves whole keys and values."""
    import copy

    from ..passes.pipeline import plan_captured

    best, cluster = None, Cluster.preset(cluster)
    for att in ("ring", "gather"):
        p = copy.copy(pol)
        p.cp_attention = att
        plan = plan_captured(cap, p, batch_size=batch_size, seq_len=seq_len, dropout=dropout)
        cost = estimate(plan, cluster, optimizer=optimizer)
        key = (not cost.fits, float(f"{cost.step_s:.9g}"), cost.memory_bytes)
        if best is None or key < best[0]:
            best = (key, p, plan)
    return best[1], best[2]


def _meshes(world_size: int, names, depth, dp) -> list[tuple[str, Mesh, int | None]]:
    """``(mode, mesh, depth)`` of every factorisation of ``world_size`` the modes ``names`` accept."""
    from ..policies import POLICIES

    out, seen = [], set()
    dps = [dp] if dp is not None else _divisors(world_size)
    for mode in names:
        cls = POLICIES[mode]
        for r in sorted(dps, reverse=False):
            if world_size % r:
                continue
            tp = world_size // r
            depths = [depth] if depth is not None else [None] + _divisors(tp)
            for dd in depths:
                try:
                    mesh = cls.make_mesh(world_size, depth=dd, dp=r)
                except (ConfigError, ValueError):
                    continue
                if mesh.world_size != world_size:
                    continue
                tp_sizes = [s for a, s in zip(mesh.axes, mesh.sizes) if a != "dp"]
                degenerate = any(s == 1 for s in tp_sizes)
                pure_dp = math.prod(tp_sizes) == 1
                if degenerate and not (pure_dp and world_size == r):
                    continue
                if pure_dp and ("pure_dp", r) in seen:
                    continue
                key = (mode, mesh)
                if key in seen:
                    continue
                seen.add(key)
                if pure_dp:
                    seen.add(("pure_dp", r))
                out.append((mode, mesh, dd))
    return out


# --------------------------------------------------------------------------- result

@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """The ranked candidates of one search. ``best`` / ``plan`` is the choice."""

    model: str
    world_size: int
    batch_size: int
    seq_len: int
    cluster: Cluster
    results: tuple[Evaluated, ...]     # ranked first (rank 1..), then dropped ones

    @property
    def ranked(self) -> list[Evaluated]:
        return [e for e in self.results if e.ok]

    @property
    def best(self) -> Evaluated:
        r = self.ranked
        if not r:
            raise ConfigError("no candidate fits")
        return r[0]

    @property
    def plan(self) -> ShardingPlan:
        return self.best.plan

    def table(self, *, top: int | None = None):
        """A ``rich.table.Table``: ranked candidates, then the dropped ones with why."""
        from rich.markup import escape
        from rich.table import Table

        t = Table(title=f"autoshard auto · {self.model} · {self.world_size} ranks · global batch "
                        f"{self.batch_size} × seq {self.seq_len} · {self.cluster.name}",
                  header_style="bold")
        for col, just in (("#", "right"), ("candidate", "left"), ("step ms", "right"), ("compute ms", "right"),
                          ("comm ms", "right"), ("comm MB", "right"), ("inter-node MB", "right"),
                          ("memory GiB", "right"), ("params+grads+opt", "right"), ("activations", "right"),
                          ("fallbacks", "right"), ("why not", "left")):
            t.add_column(col, justify=just, overflow="fold")
        rows = self.results if top is None else [e for e in self.results if e.ok][:top] + \
            [e for e in self.results if not e.ok][:top]
        for e in rows:
            c, k = e.candidate, e.cost
            if k is not None:
                nums = (f"{k.step_s * 1e3:,.1f}", f"{k.compute_s * 1e3:,.1f}", f"{k.comm_s * 1e3:,.1f}",
                        f"{k.comm_bytes / 1e6:,.0f}", f"{k.inter_node_bytes / 1e6:,.0f}",
                        _gib(k.memory_bytes), _gib(k.param_bytes + k.grad_bytes + k.optimizer_bytes),
                        _gib(k.activation_bytes), str(e.fallbacks))
            else:
                nums = ("-",) * 9
            label = c.label + (f" · async TP ×{e.async_tp}" if e.async_tp > 1 else "")
            t.add_row(*(escape(x) for x in (str(e.rank) if e.ok else "-", label, *nums, e.reason)),
                      style="bold green" if e.rank == 1 else (None if e.ok else "dim"))
        hidden = len(self.results) - len(rows)
        if hidden > 0:
            t.caption = f"{hidden} more candidate(s) not shown"
        return t

    def show(self, console=None, *, top: int | None = None) -> None:
        from rich.console import Console

        console = console or Console(width=200)
        console.print(self.table(top=top))
        if self.ranked:
            b = self.best
            console.print(f"[bold]chosen:[/bold] {b.candidate.label} (mesh {b.candidate.mesh}) · predicted step "
                          f"{b.cost.step_s * 1e3:,.1f} ms · {human_bytes(b.cost.memory_bytes)}/rank of "
                          f"{human_bytes(self.cluster.memory_bytes)}"
                          + (f" · with sharded.async_tp({b.async_tp})" if b.async_tp > 1 else ""))
            why = ep_verdict(self.results)
            if why:
                console.print(why)

    def to_dict(self) -> dict:
        return {"model": self.model, "world_size": self.world_size, "batch_size": self.batch_size,
                "seq_len": self.seq_len, "cluster": self.cluster.name,
                "candidates": [{"rank": e.rank, "label": e.candidate.label, "mode": e.candidate.mode,
                                "q": e.candidate.q, "d": e.candidate.d, "dp": e.candidate.dp,
                                "cp": e.candidate.cp, "ep": e.candidate.ep, "depth": e.candidate.depth, "mesh": str(e.candidate.mesh), "reason": e.reason,
                                "async_tp": e.async_tp,
                                "cost": e.cost.to_dict() if e.cost else None} for e in self.results]}


# --------------------------------------------------------------------------- search

def _static_bytes(captured, optimizer: str | None) -> int:
    """Parameters + gradients + optimizer state of the whole (unsharded) model."""
    seen, total, numel = set(), 0, 0
    for _, p in captured.module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
        numel += p.numel()
    opt = 8 * numel if optimizer in ("adam", "adamw") else 0
    return 2 * total + opt


#: the CostEstimate figures that are sums over a plan's nodes and parameters (linear in its layers)
_SUMS = ("flops_fwd", "compute_s", "comm_s_fwd", "comm_s_bwd", "comm_bytes", "inter_node_bytes",
         "collective_calls", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")


def _weighted(costs: list[CostEstimate], weights: list[int], fallbacks: int) -> CostEstimate:
    """The full graph's estimate from estimates of the 3-layer graph's plan (:func:`_price`):
    each summed figure ``Σ weight · figure``; the per-collective times are left out."""
    base = costs[0]
    sums = {}
    for f in _SUMS:
        v = sum(w * getattr(c, f) for c, w in zip(costs, weights))
        sums[f] = round(v) if isinstance(getattr(base, f), int) else v
    notes = tuple(n for n in base.notes if not n.endswith("fallback node(s)"))
    return dataclasses.replace(base, comms=(), notes=notes + ((f"{fallbacks} fallback node(s)",) if fallbacks else ()),
                               **sums)


class _Prepared:
    """A stamped capture's 3-layer export (:class:`~autoshard.passes.stamp.Shallow`), prepared once
    per layout that changes it (:meth:`prepared`): candidates that fold, pad the vocabulary and
    pad widths alike share one prepared graph, planned as it is
    (:func:`~autoshard.passes.pipeline.plan_prepared`: ``prepare()`` of a prepared capture
    finds nothing to do, but reading each graph again to say so cost a millisecond per
    Linear per candidate). The cp layouts' token flattens are folded once for all of them."""

    def __init__(self, shallow) -> None:
        self.base, self.lengths, self._prepared, self._tokens = shallow.base, dict(shallow.lengths), {}, None

    def prepared(self, pol):
        """The 3-layer graph as :func:`~autoshard.passes.pipeline.prepare` makes it for ``pol``."""
        from ..passes.pipeline import prepare

        key = (pol.cp > 1, pol.vocab_multiple(), pol.width_multiple(), pol.width_storage(), pol.width_copies(),
               pol.dim_splits()[0].get("hidden_size", 1))      # pad_hidden: the modes splitting the stream
        if key not in self._prepared:
            base = self.base
            if pol.cp > 1:          # prepare() finds these folds done and pads the folded graph
                if self._tokens is None:
                    from ..passes.linear_fold import fold_transposed_weights
                    from ..passes.token_fold import fold_token_flattens

                    self._tokens = fold_token_flattens(fold_transposed_weights(base))
                base = self._tokens
            self._prepared[key] = prepare(base, pol)
        return self._prepared[key]


_MID = 1        # of the KEEP = 3 layers exported per stack, the one the stamped copies are like


def _in_layer(name: str, prefix: str, i: int) -> bool:
    return name == f"{prefix}.{i}" or name.startswith(f"{prefix}.{i}.")


def _full_params(base: ShardingPlan, lengths: dict) -> tuple:
    """The full graph's parameter plans from the 3-layer graph's: per stack of ``lengths``,
    layer 0's as they are, the middle layer's once for every layer up to the last but one,
    the last layer's for the last (renamed to their layers), the rest as they are, in order.
    The figures of parameters alone (their bytes, the gradient sync's buckets, whose count is
    not linear in the layers) are then those of the full plan."""
    from ..passes.walked import evolve
    from ..passes.stamp import KEEP

    def renamed(pp, prefix: str, i: int, k: int):
        old, new = f"{prefix}.{i}.", f"{prefix}.{k}."
        return evolve(pp, name=new + pp.name[len(old):],
                      aliases=tuple(new + a[len(old):] if a.startswith(old) else a for a in pp.aliases))

    out = list(base.params)
    for prefix, n in lengths.items():
        mid = [pp for pp in out if _in_layer(pp.name, prefix, _MID)]
        grown = []
        for pp in out:
            if pp is (mid[0] if mid else None):         # the middle layer's block: once per layer 1 .. n-2
                grown += [x if k == _MID else renamed(x, prefix, _MID, k) for k in range(1, n - 1) for x in mid]
            elif _in_layer(pp.name, prefix, KEEP - 1):
                grown.append(renamed(pp, prefix, KEEP - 1, n - 1))
            elif not _in_layer(pp.name, prefix, _MID):
                grown.append(pp)
        out = grown
    return tuple(out)


def _price(cap, shallow: _Prepared | None, pol, *, batch_size: int, seq_len: int, estimate_kw: dict):
    """``(plan, fallbacks, estimate(async_tp=c) for c in 1, *ASYNC_TP_CHUNKS)`` of ``pol``:
    planned on ``cap`` itself, or where ``shallow`` is given (a stamped capture's 3-layer graph)
    priced from that graph's plan, with no plan of the full graph (docs/design.md, "Pricing the
    search"): the full graph's parameters (:func:`_full_params`) with the 3-layer graph's rows,
    and again without the rows of each stack's middle layer; a figure ``f`` summed over rows
    is ``f(3 layers) + Σ_stack (L − 3)·(f(3 layers) − f(without the middle layer))``, the
    middle layer's rows being those of every stamped copy."""
    from ..passes.pipeline import plan_captured, plan_prepared
    from ..passes.stamp import KEEP

    chunks = (1,) + (ASYNC_TP_CHUNKS if pol.name in ("1d", "1d-sp") else ())
    if shallow is None:
        plan = plan_captured(cap, pol, batch_size=batch_size, seq_len=seq_len)
        return plan, len(plan.fallbacks), _while_fits(lambda c: estimate(plan, **estimate_kw, async_tp=c), chunks)
    base = plan_prepared(shallow.prepared(pol), pol, batch_size=batch_size, seq_len=seq_len)
    params = _full_params(base, shallow.lengths)
    plans = [dataclasses.replace(base, params=params)] + [
        dataclasses.replace(base, params=params, nodes=tuple(n for n in base.nodes if not _in_layer(n.module, p, _MID)))
        for p in shallow.lengths]
    extra = [n - KEEP for n in shallow.lengths.values()]
    weights = [1 + sum(extra)] + [-e for e in extra]
    fallbacks = sum(w * len(p.fallbacks) for p, w in zip(plans, weights))
    return None, fallbacks, _while_fits(lambda c: _weighted([estimate(p, **estimate_kw, async_tp=c) for p in plans],
                                                            weights, fallbacks), chunks)


def _while_fits(cost_of, chunks: tuple) -> list[CostEstimate]:
    """``cost_of(c)`` for each chunk count of ``chunks``, the first alone where it does not fit:
    asynchronous TP changes no byte a rank holds, so the candidate is dropped whatever the chunks."""
    first = cost_of(chunks[0])
    return [first] + ([cost_of(c) for c in chunks[1:]] if first.fits else [])


def _evaluate(cap, cand: Candidate, *, batch_size: int, seq_len: int, cluster: Cluster, optimizer,
              static: int, zero: int = 0, shallow=None) -> Evaluated:
    from .validate import check_dims

    tp = cand.mesh.world_size // cand.dp // cand.cp
    if static / tp > cluster.memory_bytes:          # lower bound, no plan needed
        return Evaluated(candidate=cand, reason=f"params+grads+opt ≥ {_gib(static / tp)} GiB > "
                                                f"{_gib(cluster.memory_bytes)}")
    try:
        pol = cand.policy()
    except AutoshardError as e:
        return Evaluated(candidate=cand, reason=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    refused = [p for p in check_dims(cap.config, pol) if p.error]
    if refused:      # the same verdict as `autoshard check` / shard(): one validity function
        return Evaluated(candidate=cand, reason=str(refused[0]).split(". Valid")[0])
    if seq_len % pol.seq_split():
        return Evaluated(candidate=cand, reason=f"seq {seq_len} does not cut into {pol.seq_split()} blocks"
                                                + (f" (cp={cand.cp}, {cand.cp_order})" if cand.cp > 1 else ""))
    axes = (("dp",) if cand.dp > 1 else ()) + tuple(a for a in pol.batch_axes if a != "dp")
    if batch_size % cand.mesh.size(axes):
        return Evaluated(candidate=cand, reason=f"batch {batch_size} does not split over "
                                                f"{'·'.join(axes)}={cand.mesh.size(axes)}")
    try:
        plan, fallbacks, costs = _price(cap, shallow, pol, batch_size=batch_size, seq_len=seq_len,
                                        estimate_kw=dict(cluster=cluster, optimizer=optimizer, zero=zero))
    except AutoshardError as e:
        return Evaluated(candidate=cand, reason=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    cost = costs[0]
    if not cost.fits:
        return Evaluated(candidate=cand, plan=plan, cost=cost, fallbacks=fallbacks,
                         reason=f"needs {_gib(cost.memory_bytes)} GiB > {_gib(cluster.memory_bytes)}")
    chunks = 1
    for c, alt in zip(ASYNC_TP_CHUNKS, costs[1:]):      # asynchronous TP where the cost model says it pays
        if alt.step_s < cost.step_s:
            cost, chunks = alt, c
    return Evaluated(candidate=cand, plan=plan, cost=cost, async_tp=chunks, fallbacks=fallbacks)


def _padded_heads(cfg, pol) -> tuple[int, int]:
    """``(heads, padded)``: the query heads of ``cfg`` and how many :func:`~autoshard.passes.pad.pad_widths`
    pads them to for ``pol``'s split (grouped-query attention: each kv head's group, or its
    ``r`` copies where the split exceeds the kv heads); ``(0, 0)`` without heads."""
    h, m = getattr(cfg, "num_attention_heads", None) or 0, pol.width_multiple()
    kv = getattr(cfg, "num_key_value_heads", None) or h
    if not h or m <= 1:
        return h, h
    if kv < h and h % kv == 0:
        g = h // kv
        if kv < m and m % kv == 0:
            r = m // kv
            return h, kv * r * -(-g // r)
        return h, -(-kv // m) * m * g
    return h, -(-h // m) * m


def _evaluate_all(cap, cands: list[Candidate], kw: dict) -> list[Evaluated]:
    """Every candidate evaluated, except one whose split pads the query heads to at least
    twice their number (``1d [64]`` on 32 heads: every other rank holds a zero head) while
    another candidate fits. Its attention runs no faster than on the split half its size,
    and padding it is the dearest preparation of the search, so it is not priced
    (docs/design.md, "Pricing the search"); where nothing else fits it is."""
    wide = {}
    for c in cands:
        try:
            h, padded = _padded_heads(cap.config, c.policy())
        except AutoshardError:
            continue
        if h and padded >= 2 * h:
            wide[c] = f"pads {h} heads to {padded}: at least half of them zeros, not priced"
    out = _evaluate_each(cap, [c for c in cands if c not in wide], kw)
    if any(not e.reason for e in out):
        return out + [Evaluated(candidate=c, reason=why) for c, why in wide.items()]
    return out + _evaluate_each(cap, list(wide), kw)


def _evaluate_each(cap, cands: list[Candidate], kw: dict) -> list[Evaluated]:
    """:func:`_evaluate` of each candidate, in order; in forked processes where more than one
    CPU is usable (:mod:`autoshard.planning.workers`; docs/design.md, "Pricing the search")."""
    from .workers import map_forked, search_workers

    out = map_forked(lambda i: _evaluate(cap, cands[i], **kw), len(cands), search_workers(len(cands)))
    return [e if e.candidate is c else dataclasses.replace(e, candidate=c) for e, c in zip(out, cands)]


def _plan_chosen(cap, results: list[Evaluated], *, batch_size: int, seq_len: int, cluster: Cluster, optimizer,
                 zero: int) -> list[Evaluated]:
    """``results`` (ranked) with the first candidate planned on the full graph: its plan and
    exact estimate replace the priced ones (the same figures, summed over the whole
    graph); one whose full plan fails drops, and the next is planned."""
    from ..passes.pipeline import plan_captured

    while results and results[0].ok and results[0].plan is None:
        e = results[0]
        try:
            plan = plan_captured(cap, e.candidate.policy(), batch_size=batch_size, seq_len=seq_len)
        except AutoshardError as err:
            results = _rank([dataclasses.replace(x, rank=None, reason=f"{type(err).__name__}: "
                                                 f"{str(err).splitlines()[0]}" if x is e else x.reason)
                             for x in results])
            continue
        cost = estimate(plan, cluster, optimizer=optimizer, zero=zero, async_tp=e.async_tp)
        results = _rank([dataclasses.replace(x, plan=plan, cost=cost, fallbacks=len(plan.fallbacks))
                         if x is e else x for x in results])
    return results


def _rank(evals: list[Evaluated]) -> list[Evaluated]:
    from ..policies import POLICIES

    order = {m: i for i, m in enumerate(POLICIES)}
    ok = [e for e in evals if not e.reason]
    bad = [e for e in evals if e.reason]
    ok.sort(key=lambda e: (float(f"{e.cost.step_s:.9g}"), round(e.cost.comm_bytes), e.candidate.cp,
                           order[e.candidate.mode], e.candidate.dp, e.candidate.d, e.candidate.q,
                           e.candidate.cp_attention != "ring"))
    bad.sort(key=lambda e: (e.cost is None, e.cost.memory_bytes if e.cost else 0, e.candidate.cp,
                            order[e.candidate.mode], e.candidate.dp, e.candidate.d, e.candidate.q))
    ranked = [dataclasses.replace(e, rank=i + 1) for i, e in enumerate(ok)]
    return ranked + bad


def _captured(model_or_config, example_inputs):
    from ..launch.capture_share import capture_for_plan
    from ..passes.capture import Captured

    if isinstance(model_or_config, Captured):
        return model_or_config
    from ..io.builder import model_from

    model = model_from(model_or_config)
    model.train()
    return capture_for_plan(model, example_inputs=example_inputs)


def search(model_or_config, *, world_size: int, cluster: Cluster | str = "dgx-a100", batch_size: int = 8,
           seq_len: int = 128, modes=None, depth: int | None = None, dp: int | None = None,
           optimizer: str | None = "adamw", example_inputs: dict | None = None,
           raise_if_none: bool = True, zero: int = 0, cp: int | None = 1, cp_attention: str = "ring",
           cp_order: str = "balanced", ep: int | None = None) -> SearchResult:
    """Rank every valid ``(mode, q, d, dp, cp, ep)`` for ``world_size`` on ``cluster``.

    ``model_or_config`` is a model, a config, a local path, or a
    :class:`~autoshard.passes.capture.Captured` graph (captured once, reused by
    every candidate). ``depth`` / ``dp`` pin those values; ``cp`` pins the context-parallel
    size (default 1: none), ``cp=None`` searches it (context parallelism wins where the
    batch cannot be split further and activations or compute per rank must fall: a long
    sequence, a batch of one), the candidates using ``cp_attention`` and ``cp_order``
    (see :func:`autoshard.shard`; ``cp_attention="auto"``: each cp layout twice, with ring
    attention and with gathered keys and values). Raises ConfigError naming
    the smallest world size that fits when nothing fits (unless ``raise_if_none``
    is False). ``zero=1|2`` prices the optimizer state (and with 2 the gradients)
    split over each candidate's dp replicas (:class:`autoshard.training.zero.ZeroAdamW`);
    ``mode="1d-sp"`` candidates carry sequence parallelism's smaller activations.
    ``ep`` pins expert parallelism; ``ep=None`` (the default) weighs it, for a model with
    grouped expert matmuls, against expert-TP: each ``1d`` candidate also priced with every
    ep dividing its dp × cp (the all-to-alls at their bytes under uniform routing, no dp
    all-reduce for the experts, ``1/ep`` of their bytes), the cheapest kept, and
    :func:`ep_verdict` noted on the chosen plan's first grouped matmul.
    """
    cluster = Cluster.preset(cluster)
    cap = _captured(model_or_config, example_inputs)
    static = _static_bytes(cap, optimizer)
    # a stamped capture: every candidate priced on its 3-layer graph, the chosen one planned whole
    priced = os.environ.get("AUTOSHARD_SEARCH_PRICED", "1").strip().lower() not in ("0", "off", "false", "no")
    shallow = _Prepared(cap.shallow) if priced and getattr(cap, "shallow", None) is not None else None
    kw = dict(batch_size=batch_size, seq_len=seq_len, cluster=cluster, optimizer=optimizer, static=static, zero=zero,
              shallow=shallow)
    if ep is None and not _has_experts(cap):
        ep = 1
    cands = candidates(world_size, modes=modes, depth=depth, dp=dp, cp=cp, cp_attention=cp_attention,
                       cp_order=cp_order, ep=ep)
    if not cands:
        raise ConfigError(f"no mode accepts {world_size} ranks"
                          + (f" with depth={depth}" if depth is not None else "")
                          + (f" and dp={dp}" if dp is not None else "")
                          + (f" and cp={cp}" if cp not in (None, 1) else "")
                          + (f" and ep={ep} (1d only, dividing dp × cp)" if ep not in (None, 1) else ""))
    from ..passes.propagate import remember_row_facts

    with remember_row_facts():          # one graph (or two, priced) planned per candidate; no collection
        results = _rank(_evaluate_all(cap, cands, kw))
        if shallow is not None:
            results = _plan_chosen(cap, results, batch_size=batch_size, seq_len=seq_len, cluster=cluster,
                                   optimizer=optimizer, zero=zero)
    results = _note_ep_verdict(results)
    res = SearchResult(model=cap.model_name, world_size=world_size, batch_size=batch_size, seq_len=seq_len,
                       cluster=cluster, results=tuple(results))
    if res.ranked or not raise_if_none:
        return res
    raise ConfigError(_nothing_fits(cap, res, modes=modes, depth=depth, dp=dp, static=static, kw=kw,
                                    cp=dict(cp=cp, cp_attention=cp_attention, cp_order=cp_order)))


def _nothing_fits(cap, res: SearchResult, *, modes, depth, dp, static, kw, cp: dict) -> str:
    world, cluster = res.world_size, res.cluster
    costed = [e for e in res.results if e.cost is not None]
    head = f"nothing fits in {human_bytes(cluster.memory_bytes)} per rank on {world} ranks ({cluster.name})"
    if costed:
        e = min(costed, key=lambda e: e.cost.memory_bytes)
        head += f"; the leanest candidate, {e.candidate.label}, needs {human_bytes(e.cost.memory_bytes)}"
    else:
        reasons = sorted({e.reason for e in res.results})[:3]
        head += "; " + "; ".join(reasons)
    for w in range(world + 1, _MAX_UPWARD + 1):
        if static / w > cluster.memory_bytes:          # even a perfect split cannot fit
            continue
        if dp is not None and w % dp:
            continue
        for c in candidates(w, modes=modes, depth=depth, dp=dp, **cp):
            e = _evaluate(cap, c, **kw)
            if not e.reason:
                return (f"{head}. The smallest world size that fits is {w} "
                        f"({c.label}, {human_bytes(e.cost.memory_bytes)} per rank).")
    return f"{head}. No world size up to {_MAX_UPWARD} fits either."


# --------------------------------------------------------------------------- expert parallelism
def _has_experts(cap) -> bool:
    """Whether ``cap``'s graph runs a grouped matmul (a mixture-of-experts layer's experts):
    the ops expert parallelism is planned from (docs/design.md, "Expert parallelism")."""
    from ..ir.grouped import grouped_targets

    ops = grouped_targets(folded=True)
    return any(n.op == "call_function" and n.target in ops for n in cap.module.graph.nodes)


def _a2a_mb(e: Evaluated) -> str:
    if e.plan is None:
        return ""
    b = sum(c.bytes_per_rank for c in e.plan.comms() if c.kind == "all_to_all")
    return f", {b / 1e6:,.2f} MB of it all-to-all at uniform routing" if b else ""


def ep_verdict(results) -> str:
    """Why the search chose expert parallelism or expert-TP: the chosen candidate against
    the best of the other kind on the same mesh (else on any), by predicted step time,
    bytes sent per rank and memory per rank; ``""`` when no ep candidate was weighed.

    >>> ep_verdict([])
    ''
    """
    ok = [e for e in results if e.ok]
    if not ok or not any(e.candidate.ep > 1 for e in results):
        return ""
    best = ok[0]
    other = [e for e in ok if (e.candidate.ep > 1) != (best.candidate.ep > 1)]
    same = [e for e in other if e.candidate.mesh == best.candidate.mesh]
    if not (same or other):
        dropped = next((e for e in results if e.candidate.ep > 1 and not e.ok), None)
        return (f"expert parallelism: not chosen ({dropped.candidate.label}: {dropped.reason})" if dropped and
                best.candidate.ep == 1 else "")
    alt = (same or other)[0]

    def side(e):
        k = e.cost
        return (f"{e.candidate.label}: step {k.step_s * 1e3:,.3f} ms, {k.comm_bytes / 1e6:,.2f} MB sent per "
                f"rank{_a2a_mb(e)}, {human_bytes(k.memory_bytes)} per rank")

    what = f"ep={best.candidate.ep}" if best.candidate.ep > 1 else "expert-TP (ep=1)"
    return f"experts: {what} chosen by the cost model ({side(best)}) over {side(alt)}"


def _note_ep_verdict(results: list[Evaluated]) -> list[Evaluated]:
    """``results`` with :func:`ep_verdict` a note of the chosen plan's first grouped matmul."""
    why = ep_verdict(results)
    if not why or not results or not results[0].ok or results[0].plan is None:
        return results
    plan = results[0].plan
    first = next((n for n in plan.nodes if "grouped" in n.op), None)
    if first is None:
        return results
    nodes = tuple(dataclasses.replace(n, notes=n.notes + (why,)) if n is first else n for n in plan.nodes)
    return [dataclasses.replace(results[0], plan=dataclasses.replace(plan, nodes=nodes))] + list(results[1:])
