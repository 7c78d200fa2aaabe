"""The planning pipeline after capture: pad, propagate, then the activation trace.

``capture → fold experts → pad → annotate → propagate → trace → rewrite``: the experts' token
counts are taken on floats (:func:`~autoshard.passes.experts.count_on_floats`), the vocabulary is
padded to the mode's split (:mod:`~autoshard.passes.pad`; the rewrite must take
the padded module, :func:`prepare`); annotation runs inside
propagation (the rules read it); the trace is its own pass over the finished
plan; the rewrite is per rank (:func:`autoshard.passes.rewrite.rewrite`).
"""

from __future__ import annotations

from autoshard.ir.errors import AutoshardWarning, ShardingError
from autoshard.ir.log import warn
from autoshard.ir.plan import ShardingPlan
from autoshard.ir.signature import main_input
from autoshard.policies.base import Policy

from .capture import Captured
from .experts import count_on_floats, fold_grouped_weights, plan_expert_parallel
from .linear_fold import fold_transposed_weights
from .squeeze_fold import fold_bare_squeezes
from .pad import pad_hidden, pad_vocab, pad_widths
from .token_fold import fold_token_flattens
from .propagate import propagate
from .trace import trace

__all__ = ["plan_captured", "plan_prepared", "prepare"]


def prepare(captured: Captured, policy: Policy, *, vocab: int | None = None) -> Captured:
    """``captured`` as ``policy`` plans it: ``x @ W.T`` as ``linear(x, W)``
    (:mod:`~autoshard.passes.linear_fold`), with context parallelism per-token ops on
    unflattened tokens (:mod:`~autoshard.passes.token_fold`), grouped expert matmuls with their
    parameter as a direct operand (:mod:`~autoshard.passes.experts`), the vocabulary
    padded to the mode's split, and heads and widths the split does not divide padded
    with zero units (:func:`~autoshard.passes.pad.pad_widths`; the same object where
    nothing changes), ``squeeze()`` naming the dims it drops
    (:mod:`~autoshard.passes.squeeze_fold`). Plan and
    rewrite this one. ``vocab``: the vocabulary's size, where the graph has no head to
    tell it (:func:`~autoshard.passes.pad.pad_vocab`)."""
    folded = fold_bare_squeezes(fold_transposed_weights(captured))
    if policy.cp > 1:       # a split sequence cannot merge into a whole batch: tokens kept apart
        folded = fold_token_flattens(folded)
    padded = pad_vocab(fold_grouped_weights(count_on_floats(folded)), policy.vocab_multiple(), vocab)
    cfg = captured.config
    padded = pad_widths(padded, policy.width_multiple(), heads=getattr(cfg, "num_attention_heads", None),
                        kv_heads=getattr(cfg, "num_key_value_heads", None), storage=policy.width_storage(),
                        copies=policy.width_copies())
    (splits, label), h = policy.dim_splits(), getattr(cfg, "hidden_size", None)
    out = pad_hidden(padded, splits.get("hidden_size", 1), h, storage=policy.width_storage())
    if out is padded and h and h % splits.get("hidden_size", 1):     # (check_dims, seeing no graph, said padded)
        warn(f"hidden_size={h} does not divide the {policy.name} split {splits['hidden_size']} ({label}) and the pad "
             f"pass cannot pad it (a norm whose statistics it cannot take over the dense width, or weights padded "
             f"on another dim already): the residual stream is held whole (exact, unsplit)", AutoshardWarning)
    return out


def plan_captured(captured: Captured, policy: Policy, *, batch_size: int, seq_len: int,
                  gather_outputs: bool = True, dropout: str = "sharded", pinned: dict | None = None,
                  frozen: frozenset[str] | None = None) -> ShardingPlan:
    """The finished plan of ``captured`` under ``policy``: :func:`prepare`, then
    :func:`plan_prepared` (the search's form: each candidate prepares its own capture;
    the launch pipeline, :mod:`autoshard.launch.pipeline`, prepares once and plans the result)."""
    _check_cp_attention(policy)
    _check_batch_dynamic(captured, policy)
    return plan_prepared(prepare(captured, policy), policy, batch_size=batch_size, seq_len=seq_len,
                         gather_outputs=gather_outputs, dropout=dropout, pinned=pinned, frozen=frozen)


def plan_prepared(prepared: Captured, policy: Policy, *, batch_size: int, seq_len: int,
                  gather_outputs: bool = True, dropout: str = "sharded", pinned: dict | None = None,
                  frozen: frozenset[str] | None = None) -> ShardingPlan:
    """The finished plan of ``prepared`` (what :func:`prepare` made of a capture under
    ``policy``): specs, kernels and
    collectives (:func:`~autoshard.passes.propagate.propagate`) and the tensors each
    node saves for backward (:func:`~autoshard.passes.trace.trace`). ``pinned``: parameter
    layouts fixed beforehand, ``frozen``: the names of the parameters with ``requires_grad=False``
    in the model (default: those of ``prepared.module``; :func:`~autoshard.passes.propagate.propagate`).
    A policy's ``cp_attention="auto"`` is chosen before, by the cost model
    (:func:`autoshard.planning.search.choose_cp_attention`, which ``plan()`` and ``shard()`` call)."""
    _check_cp_attention(policy)
    _check_batch_dynamic(prepared, policy)
    p = propagate(prepared, policy, batch_size=batch_size, seq_len=seq_len, gather_outputs=gather_outputs,
                  dropout=dropout, pinned=pinned, frozen=frozen)
    p = trace(p, prepared.module)
    if policy.ep > 1:       # the experts over the dp (× cp) ranks: the mode's plan, then their split
        p = plan_expert_parallel(p, prepared.module, policy.ep)
    return p


def _check_cp_attention(policy: Policy) -> None:
    if policy.cp > 1 and policy.cp_attention not in ("ring", "gather"):
        raise ValueError(f"cp_attention={policy.cp_attention!r} reaches the planner unresolved: choose it first "
                         f"(autoshard.planning.search.choose_cp_attention)")


def _check_batch_dynamic(captured: Captured, policy: Policy) -> None:
    """A graph whose batch torch.export had to make static (the model reads the batch
    size as a Python int: CLIP's contrastive loss takes ``len(logits)``, LLaVA lists its
    image features per sample) is planned with its batch whole on every rank: the
    tensor-parallel modes keep the rows whole (SUMMA and 3D run with ``rows_whole``), so a
    loss comparing every sample with every other sees them all. Data and context
    parallelism hand each rank other rows or tokens of it, which such a graph cannot
    take (a block-local contrastive loss would be a silent wrong answer): refused."""
    if captured.batch_symbol is not None:
        return
    axes = [f"{a}[{policy.mesh.size(a)}]" for a in ("dp", "cp") if a in policy.mesh.axes and policy.mesh.size(a) > 1]
    if not axes:
        return
    name = main_input(captured.example_inputs)
    node = next((n for n in captured.module.graph.nodes if n.op == "placeholder" and n.name == name), None)
    raise ShardingError(f"{captured.model_name}'s graph has a static batch: torch.export specialised it because the "
                        f"model reads the batch size as a Python int (e.g. len(logits) in a contrastive loss, or "
                        f"image features listed per sample), so every rank must hold the whole batch and "
                        f"{' and '.join(axes)} cannot split it. Valid here: mode={policy.name!r} (or any other) with "
                        f"dp=1 and cp=1, which keep the batch whole", node=node)
