"""A new graph for a call whose inputs no captured graph has (another set of keyword
arguments, dtypes or static dims; see :mod:`autoshard.ir.signature`).

The model is rebuilt on the meta device from the config and class
:func:`autoshard.shard` recorded (:class:`~autoshard.module.Recipe`), captured
with the call's own inputs (as meta tensors, at a small batch and sequence:
both dims stay dynamic), planned with the same policy and rewritten for this
rank; the new graph then takes the module's own parameters (the slices already
held, trained or not) and buffers, so every graph of a module shares one set
of weights. The planned parameter layouts must agree with the first graph's,
or the call is refused.

Every rank captures the same graph for the same signature (the meta capture
does not depend on the rank or the weights); the only collective is creating a
process group the first graph did not need, so every rank of the job must make
calls with the same kinds of inputs, as it must for any collective.

Cost: one ``torch.export`` of the model on meta plus the planning, once per
signature (about what :func:`autoshard.shard` took, less the weight slicing).
"""

from __future__ import annotations

import copy
import time

import torch

from ..io.builder import Built, build_meta
from ..ir.errors import ConfigError
from ..io.hf_fill import fill_buffers, set_param
from ..ir.log import logger
from .pipeline import PIPELINE, recipe_state
from ..ir.signature import InputSignature, SignatureGraph, batch_inputs, pad_blocker, seq_of

__all__ = ["capture_graph", "meta_example", "rewrite_bound"]


def meta_example(kwargs: dict, *, batch: int = 2, seq: int = 8, max_seq: int | None = None) -> dict:
    """``kwargs`` as meta tensors of the same dtypes and static dims, with the batch dim
    made ``batch`` and the sequence dim ``seq`` (capped below ``max_seq``): export
    specialises sizes 0 and 1, and equal batch and sequence sizes would be one symbol.

    >>> ex = meta_example({"input_ids": torch.zeros(1, 3, dtype=torch.long), "use_cache": False})
    >>> ex["input_ids"].shape, ex["input_ids"].device.type, ex["use_cache"]
    (torch.Size([2, 8]), 'meta', False)
    """
    if max_seq is not None:
        seq = max(3, min(seq, max_seq - 1))
    if seq == batch:
        seq += 1
    sig = InputSignature.of(kwargs)
    out = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    for name, dtype, dims in sig.tensors:
        shape = [batch if d == "b" else seq if d == "s" else d for d in dims]
        out[name] = torch.zeros(shape, dtype=getattr(torch, dtype), device="meta")
    return out


def rewrite_bound(module, cap, p, built):
    """``cap`` rewritten under plan ``p`` for ``module``'s rank, its parameters the
    module's own slices (every graph of a module trains one set of weights), its
    buffers the module's or, where the module has none, the values ``built`` holds.
    Collective where ``p`` needs a process group the module did not."""
    held = module.plan.params_by_name()
    state = PIPELINE.run(recipe_state(module.recipe, prepared=cap, plan=p, rank=module.rank,
                                      batch_size=module.recipe.batch_size, seq_len=module.recipe.seq_len),
                         "groups", "rewrite")
    module.groups.update(state.groups)
    gm = state.gm
    own = module.graph_module()
    for pp in p.params:
        name = next(n for n in (pp.name, *pp.aliases) if n in held)
        set_param(gm, (pp.name, *pp.aliases), own.get_parameter(held[name].name))
    own_buffers = dict(own.named_buffers(remove_duplicate=False))
    for name, buf in list(gm.named_buffers(remove_duplicate=False)):
        if buf.device.type == "meta" and name in own_buffers:
            mod_path, _, attr = name.rpartition(".")
            (gm.get_submodule(mod_path) if mod_path else gm)._buffers[attr] = own_buffers[name]
    fill_buffers(gm, built, device=module.device)
    return gm


def capture_graph(module, kwargs: dict, *, batch: int | None = None):
    """Capture, plan and rewrite ``module``'s model for the inputs of ``kwargs``; return
    the module's new graph entry (its parameters bound to the module's own). ``batch``:
    capture at this batch size (the call's, where export makes the batch static: a
    graph for that batch size only); default a small one (the batch stays dynamic)."""
    r = module.recipe
    t0 = time.perf_counter()
    if r.skeleton is not None:      # a module with no config: a copy of its skeleton on meta
        built = Built(copy.deepcopy(r.skeleton.model), r.skeleton.buffers, r.skeleton.persistent, None)
    else:
        built = build_meta(r.config, model_class=r.model_class, dtype=module.dtype, adapt=r.adapt)
    built.model.train(r.training)
    lim = module.limits.get("max_positions")
    if module.limits.get("static_seq") is not None:     # static in its graphs: the call's exact length,
        seq = seq_of(kwargs)                            # a batch of another size
        example = meta_example(kwargs, seq=seq, batch=batch or (3 if seq == 2 else 2))
    else:
        example = meta_example(kwargs, max_seq=lim[1] if lim else None, batch=batch or 2)
    frozen = frozenset(n for pp in module.plan.params if not pp.trainable for n in (pp.name, *pp.aliases))
    state = PIPELINE.run(recipe_state(r, model=built.model, example_inputs=example, frozen=frozen,
                                      batch_size=r.batch_size, seq_len=r.seq_len),
                         "capture", "prepare", "plan")     # collective: every rank makes the shared capture
    cap, p = state.prepared, state.plan
    sig = InputSignature.of(example).describe()
    held = module.plan.params_by_name()
    for pp in p.params:
        mine = next((held[n] for n in (pp.name, *pp.aliases) if n in held), None)
        if mine is None or tuple(mine.global_shape) != tuple(pp.global_shape):
            raise ConfigError(f"the model rebuilt from its config for inputs {sig} has parameter {pp.name!r} "
                              f"{list(pp.global_shape)} that the sharded module does not hold alike (was the model "
                              f"changed after it was built?); pass example_inputs with these inputs to shard()")
        if mine.spec != pp.spec:
            raise ConfigError(f"for inputs {sig} the plan splits parameter {pp.name!r} as {pp.spec}, the module "
                              f"holds it as {mine.spec}; pass example_inputs with these inputs to shard()")
    gm = rewrite_bound(module, cap, p, built)
    if r.activation_checkpointing:
        from ..passes.remat import checkpoint_blocks

        checkpoint_blocks(gm)
    logger.info("captured a graph for inputs %s in %.1f s", sig, time.perf_counter() - t0)
    rows = batch_inputs(cap.module, cap.batch_symbol)
    static_seq = cap.seq_range[0] == cap.seq_range[1]
    return SignatureGraph(gm, p, cap.input_names, dict(cap.constants),
                          InputSignature.of(cap.example_inputs, static_batch=not rows, static_seq=static_seq), rows,
                          pad_blocker(cap.module, cap.batch_symbol), static_seq)
