"""Training pieces for a :class:`~autoshard.module.ShardedModule`: global gradient
clipping, per-replica batches, AdamW with warmup + cosine decay, gradient
accumulation, bf16 autocast and a small loop that reports on rank 0.

Every function here is called on every rank (the norm is a collective)::

    opt, sched = autoshard.training.train.make_optimizer(sharded, lr=3e-4, steps=100)
    losses = autoshard.training.train.train(sharded, batches, steps=100, optimizer=opt, scheduler=sched,
                                   accum=2, clip=1.0)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from ..io.gather import unique_params
from ..sharded.grads import grad_norm, local_grad

__all__ = ["clip_grad_norm_", "grad_norm", "replica_batches", "local_rows", "make_optimizer",
           "warmup_cosine", "train_step", "train", "local_rows_for", "save_state", "load_state",
           "last_complete_state", "collectives_guard"]

_STATE = "train_state.json"

# What c10d / gloo / NCCL say when a peer is gone or a collective timed out.
_PEER_LOST = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "nccl error",
              "socket", "peer", "aborted")


@contextlib.contextmanager
def collectives_guard(what: str):
    """Turn a collective that failed because another rank died or stalled (gloo or
    NCCL, after the process group's timeout, ``AUTOSHARD_TIMEOUT``) into a
    :class:`~autoshard.ir.errors.CollectiveError` that says so and how to resume::

        with collectives_guard(f"step {step}"):
            train_step(sharded, mbs, opt, sched)
    """
    from ..ir.errors import AutoshardError, CollectiveError

    try:
        yield
    except AutoshardError:
        raise
    except RuntimeError as e:
        text = str(e)
        if not (isinstance(e, getattr(dist, "DistError", ())) or any(k in text.lower() for k in _PEER_LOST)):
            raise
        rank = _rank()
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        raise CollectiveError(
            f"rank {rank}: a collective failed during {what}: another rank died or stalled "
            f"(collective timeout {os.environ.get('AUTOSHARD_TIMEOUT', 'default')} s). Resume every rank from "
            f"the last complete checkpoint (autoshard.training.train.last_complete_state). Cause: {type(e).__name__}: "
            f"{first[:300]}") from e


def clip_grad_norm_(sharded, max_norm: float) -> torch.Tensor:
    """Like :func:`torch.nn.utils.clip_grad_norm_` on the dense model: computes the
    global gradient norm over all shards (see :func:`grad_norm`), scales every local
    gradient by ``min(1, max_norm / (norm + 1e-6))`` and returns the norm."""
    norm = grad_norm(sharded)
    coef = (float(max_norm) / (norm + 1e-6)).clamp(max=1.0)     # on the device: no host sync
    for _, p in unique_params(sharded):
        if p.grad is not None:
            local_grad(p).mul_(coef.to(p.grad.dtype))
    return norm.float()


def local_rows(sharded, batch: dict) -> dict:
    """This dp replica's rows of a global batch (all of it when dp = 1); the TP ranks
    of one replica get the same rows."""
    mesh = sharded.mesh
    n_dp = mesh.dp
    if n_dp == 1:
        return batch
    i = sharded.coords["dp"]
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            b = v.shape[0]
            if b % n_dp:
                raise ValueError(f"global batch {b} is not divisible by dp = {n_dp}")
            out[k] = v[i * (b // n_dp):(i + 1) * (b // n_dp)]
        else:
            out[k] = v
    return out


def local_rows_for(dp: int, dp_index: int, batch: dict) -> dict:
    """Replica ``dp_index``'s rows of a global batch (before a module exists, e.g.
    for ``example_inputs``)."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            per = v.shape[0] // dp
            out[k] = v[dp_index * per:(dp_index + 1) * per]
        else:
            out[k] = v
    return out


def save_state(sharded, path, optimizer=None, *, step: int, extra: dict | None = None) -> None:
    """Sharded checkpoint (:func:`autoshard.io.sharded_format.save_checkpoint`: weights and
    AdamW state) plus ``train_state.json`` (the step; the LR schedule is a function
    of it). Collective.

    A save killed at any point leaves a folder :func:`load_state` refuses: the old
    ``train_state.json`` is removed before the weights are written, the manifest is
    committed after them, and the new ``train_state.json`` (atomically) after that."""
    from ..runtime.heartbeat import note_checkpoint
    from ..io.safetensors_io import write_atomic
    from ..io.sharded_format import save_checkpoint

    path = Path(path)
    if _rank() == 0:
        (path / _STATE).unlink(missing_ok=True)
    save_checkpoint(sharded, path, optimizer)      # barriers: rank 0's unlink happened before
    if _rank() == 0:
        write_atomic(path / _STATE, json.dumps({"step": int(step), **(extra or {})}))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    note_checkpoint(path)       # named when a frozen rank ends the job (autoshard.runtime.heartbeat)


def _state_step(path: Path) -> int:
    from ..io.sharded_format import read_manifest
    from ..ir.errors import CheckpointError

    read_manifest(path)         # refuses a checkpoint whose writer did not commit
    sp = path / _STATE
    if not sp.exists():
        raise CheckpointError(f"{sp}: missing: the save was killed after the weights were committed, "
                              f"or this folder was not written by autoshard.training.train.save_state")
    try:
        return int(json.loads(sp.read_text())["step"])
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{sp}: unreadable ({type(e).__name__}: {e})") from e


def last_complete_state(root) -> Path:
    """The folder under ``root`` (or ``root`` itself) holding the complete
    :func:`save_state` checkpoint with the highest step; incomplete ones (killed
    mid-save) are skipped. :class:`~autoshard.ir.errors.CheckpointError` if none."""
    from ..ir.errors import AutoshardError, CheckpointError

    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"no such directory: {root}")
    best, why = None, []
    for d in [root, *sorted(p for p in root.iterdir() if p.is_dir())] if root.is_dir() else []:
        try:
            step = _state_step(d)
        except AutoshardError as e:
            if d != root:
                why.append(str(e).splitlines()[0])
            continue
        if best is None or step > best[0]:
            best = (step, d)
    if best is None:
        raise CheckpointError(f"{root}: no complete checkpoint" + (f" ({'; '.join(why[:3])})" if why else ""))
    return best[1]


def load_state(path, model, *, mode: str, depth: int | None = None, dp: int = 1, example_inputs: dict,
               lr: float, steps: int, warmup: int = 0, weight_decay: float = 0.0, min_ratio: float = 0.0,
               zero: int = 0):
    """Rebuild ``(sharded, optimizer, scheduler, step)`` from :func:`save_state`'s folder
    (any mode / world size the checkpoint module supports; ``zero=1|2`` resumes with
    the state sharded over this run's ``dp``, whatever the saving run used). A folder
    whose save was killed is refused before any process group is touched."""
    from ..load import load_checkpoint

    step = _state_step(Path(path))
    sharded, opt = load_checkpoint(path, model, mode=mode, depth=depth, dp=dp, example_inputs=example_inputs,
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=weight_decay))
    for g in opt.param_groups:
        g["initial_lr"] = lr
    if zero:
        from .zero import ZeroAdamW

        opt = ZeroAdamW.from_optimizer(sharded, opt, stage=zero)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps, warmup, min_ratio), last_epoch=step - 1)
    return sharded, opt, sched, step


def replica_batches(examples: dict, batch_size: int, *, seed: int = 0, dp_index: int = 0, dp: int = 1,
                    epochs: int | None = None) -> Iterator[dict]:
    """Endless (or ``epochs``-long) DataLoader-free iterator over ``examples`` (a dict
    of tensors with the same first dim). Each epoch is a permutation drawn from
    ``seed`` (the same on every rank); a global batch of ``batch_size`` rows is cut
    from it and replica ``dp_index`` of ``dp`` gets its contiguous share."""
    n = next(iter(examples.values())).shape[0]
    if batch_size % dp:
        raise ValueError(f"batch size {batch_size} is not divisible by dp = {dp}")
    if n < batch_size:
        raise ValueError(f"{n} examples are fewer than one batch of {batch_size}")
    per = batch_size // dp
    g = torch.Generator(device="cpu").manual_seed(seed)     # batches are cut on the host
    epoch = 0
    while epochs is None or epoch < epochs:
        perm = torch.randperm(n, generator=g, device="cpu")
        for s in range(0, n - batch_size + 1, batch_size):
            idx = perm[s + dp_index * per: s + (dp_index + 1) * per]
            yield {k: v[idx] for k, v in examples.items()}
        epoch += 1


def warmup_cosine(steps: int, warmup: int = 0, min_ratio: float = 0.0) -> Callable[[int], float]:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine to ``min_ratio``."""
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


def make_optimizer(module: torch.nn.Module, *, lr: float, steps: int, warmup: int = 0, weight_decay: float = 0.0,
                   betas=(0.9, 0.999), min_ratio: float = 0.0, zero: int = 0):
    """AdamW over the trainable local shards + LambdaLR(linear warmup, cosine decay) (frozen
    parameters, e.g. a base under LoRA, get no optimizer state).
    ``zero=1`` shards the AdamW state over the data-parallel replicas, ``zero=2``
    the gradients too (:class:`autoshard.training.zero.ZeroAdamW`; collective)."""
    if zero:
        from .zero import ZeroAdamW

        opt = ZeroAdamW(module, stage=zero, lr=lr, betas=betas, weight_decay=weight_decay)
    else:
        opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr, betas=betas,
                                weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps, warmup, min_ratio))
    return opt, sched


def _is_sharded(m) -> bool:
    return hasattr(m, "plan") and hasattr(m, "mesh")


def train_step(module, micro_batches: list[dict], optimizer, scheduler=None, *, clip: float | None = None,
               dtype: torch.dtype | None = None) -> tuple[float, float | None]:
    """One optimizer step over ``len(micro_batches)`` accumulated micro-batches
    (each loss / accum, backward per micro-batch). Returns (loss, grad norm before
    clipping; None without ``clip``). Works on a ShardedModule or a dense model; a
    pipeline-parallel module (``shard(..., pp=P)``) runs its schedule over the micro-batches
    (:func:`autoshard.training.pipeline.pipeline_train_step`)."""
    if getattr(module, "pipelined", False):
        from .pipeline import pipeline_train_step

        return pipeline_train_step(module, micro_batches, optimizer, scheduler, clip=clip, dtype=dtype)
    optimizer.zero_grad(set_to_none=True)
    accum = len(micro_batches)
    total = None
    device = _device_of(module)
    for mb in micro_batches:
        if dtype is not None and dtype != torch.float32:
            with torch.autocast(device.type, dtype=dtype):       # autocast follows the module's device
                loss = module(**mb).loss
        else:
            loss = module(**mb).loss
        (loss / accum).backward()
        part = loss.detach().float() / accum        # summed on the device: one host read per step
        total = part if total is None else total + part
    norm = None
    if clip is not None:        # a device tensor: read with the loss after the step is launched, no stall before it
        if hasattr(optimizer, "clip_grad_norm_"):        # autoshard.training.zero.ZeroAdamW: the norm of its chunks
            norm = optimizer.clip_grad_norm_(clip)
        elif _is_sharded(module):
            norm = clip_grad_norm_(module, clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return (float(total) if total is not None else 0.0), (float(norm) if norm is not None else None)


def _device_of(module) -> torch.device:
    """The device of ``module``'s parameters (a ShardedModule's ``device``; CPU if none)."""
    dev = getattr(module, "device", None)
    if isinstance(dev, torch.device):
        return dev
    p = next(iter(module.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def train(module, batches: Iterable[dict], steps: int, *, lr: float = 1e-4, accum: int = 1,
          clip: float | None = None, optimizer=None, scheduler=None, warmup: int = 0,
          dtype: torch.dtype | None = None, start_step: int = 0, log: bool = True,
          on_step: Callable[[int, float], None] | None = None, global_tokens: Callable[[dict], int] | None = None,
          ) -> list[float]:
    """Run ``steps - start_step`` optimizer steps, each over ``accum`` micro-batches
    drawn from ``batches`` (this replica's rows). Prints, on rank 0 only, a rich
    progress bar and one line per step: loss, tokens/s, lr, grad norm. Returns the
    losses (global means, identical on every rank). ``on_step(step, loss)`` runs
    after each step (e.g. evaluation or checkpointing)."""
    if optimizer is None:
        optimizer, scheduler = make_optimizer(module, lr=lr, steps=steps, warmup=warmup)
    it = iter(batches)
    n_dp = module.mesh.dp if _is_sharded(module) else 1
    show = log and _rank() == 0
    losses: list[float] = []
    progress = None
    if show:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            TextColumn("{task.fields[info]}"))
        progress.start()
        task = progress.add_task("train", total=steps, completed=start_step, info="")
    try:
        for step in range(start_step, steps):
            mbs = [next(it) for _ in range(accum)]
            t0 = time.perf_counter()
            cur_lr = optimizer.param_groups[0]["lr"]
            with collectives_guard(f"step {step + 1}"):
                loss, norm = train_step(module, mbs, optimizer, scheduler, clip=clip, dtype=dtype)
            dt = time.perf_counter() - t0
            losses.append(loss)
            if show:
                toks = sum(global_tokens(mb) if global_tokens else _tokens(mb) * n_dp for mb in mbs)
                gn = f"  grad norm {norm:.4f}" if norm is not None else ""
                line = f"step {step + 1:>4}/{steps}  loss {loss:.4f}  {toks / dt:,.0f} tok/s  lr {cur_lr:.2e}{gn}"
                progress.console.print(line)
                progress.update(task, advance=1, info=f"loss {loss:.4f}")
            if on_step is not None:
                on_step(step + 1, loss)
    finally:
        if progress is not None:
            progress.stop()
    return losses


def _tokens(mb: dict) -> int:
    if "attention_mask" in mb and isinstance(mb["attention_mask"], torch.Tensor):
        return int(mb["attention_mask"].sum())
    return int(mb["input_ids"].numel())
