"""One device rule for every rank (docs/design.md, "Devices").

A rank's device is ``cuda:LOCAL_RANK`` when the job runs on NCCL and the CPU when
it runs on gloo. Everything follows from it:

* :func:`init_process_group` picks the backend, calls ``torch.cuda.set_device``
  *before* creating the group and passes ``device_id=`` (so NCCL binds each rank to
  its own GPU: without it every rank lands on GPU 0);
* :func:`rank_device` is where ``shard()`` puts the slices and the loaders read them;
* :func:`comm_device` is where a tensor handed to a collective of the default group
  lives (NCCL takes CUDA tensors only);
* :func:`retarget` points a graph's device literals (``arange(..., device=...)``,
  ``_to_copy``) and its lifted constants at a device, so a graph captured on one
  rank's device (or on meta) runs on another's.

    >>> rank_device("gloo")
    device(type='cpu')
    >>> local_rank({"LOCAL_RANK": "3"})
    3
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["local_rank", "backend_for", "rank_device", "comm_device", "init_process_group", "retarget",
           "lifted_constants"]


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank on its node: ``LOCAL_RANK`` (set by torchrun), else 0."""
    env = os.environ if environ is None else environ
    raw = env.get("LOCAL_RANK", "0") or "0"
    try:
        return int(raw)
    except ValueError:
        from ..ir.errors import ConfigError
        raise ConfigError(f"LOCAL_RANK={raw!r} must be an integer (torchrun sets it)") from None


def backend_for() -> str:
    """``"nccl"`` where CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def rank_device(backend: str | None = None, environ: Mapping[str, str] | None = None) -> torch.device:
    """This rank's device under ``backend`` (default: the running group's, else
    :func:`backend_for`): ``cuda:LOCAL_RANK`` for NCCL, CPU otherwise."""
    if backend is None:
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else backend_for()
    if backend == "nccl":
        return torch.device("cuda", local_rank(environ))
    return torch.device("cpu")


def comm_device() -> torch.device:
    """Where a tensor given to a collective of the default group must live: the
    current CUDA device under NCCL, the CPU under gloo."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(*, timeout_s: float | None = None, environ: Mapping[str, str] | None = None) -> str:
    """Join the torchrun job on this rank's device; returns the backend.

    Under NCCL the rank's GPU is made current (``torch.cuda.set_device``) first and
    passed as ``device_id``, which binds the communicator to it eagerly, and a timed-out
    collective raises instead of ending the process (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``
    unless set). A GPU index past ``torch.cuda.device_count()`` is refused before any
    collective."""
    backend = backend_for()
    kw = {}
    if timeout_s is not None:
        kw["timeout"] = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        dev = rank_device("nccl", environ)
        n = torch.cuda.device_count()
        if dev.index >= n:
            from ..ir.errors import ConfigError
            raise ConfigError(f"LOCAL_RANK={dev.index} but this node has {n} GPU(s) (cuda:0..cuda:{n - 1}): "
                              f"start at most {n} processes per node (torchrun --nproc-per-node {n})")
        torch.cuda.set_device(dev)
        kw["device_id"] = dev
        # NCCL's watchdog ends the process on a timed-out collective by default; "2" (clean
        # up only) aborts the communicator and lets the waiting call raise, which
        # autoshard turns into a CollectiveError with its resume hint. The user's setting wins.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    dist.init_process_group(backend, **kw)
    return backend


def _move_literal(v, device: torch.device):
    if isinstance(v, torch.device):
        return device, v != device
    if isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
        moved = [_move_literal(x, device) for x in v]
        out = [m[0] for m in moved]
        return (out if isinstance(v, list) else tuple(out)), any(m[1] for m in moved)
    if isinstance(v, dict):
        moved = {k: _move_literal(x, device) for k, x in v.items()}
        return {k: m[0] for k, m in moved.items()}, any(m[1] for m in moved.values())
    return v, False


def lifted_constants(gm: torch.nn.Module):
    """``(owner module, attribute name, tensor)`` for every tensor attribute of the fx
    graph modules under ``gm`` that is neither a parameter nor a buffer (the constants
    ``torch.export`` lifts, e.g. ``_tensor_constant0``): ``nn.Module.to`` leaves them
    where they are."""
    from torch import fx

    for mod in gm.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        for name, value in list(vars(mod).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                    and name not in mod._buffers and not name.startswith("__"):
                yield mod, name, value


def retarget(gm: torch.nn.Module, device: torch.device | str) -> int:
    """Point every device literal of the fx graphs under ``gm`` at ``device`` and move
    its lifted constants there; returns the number of literals changed. Parameters
    and buffers are the caller's (``module.to``)."""
    from torch import fx

    device = torch.device(device)
    changed = 0
    for mod in gm.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        before = changed
        for node in mod.graph.nodes:
            if node.op in ("call_function", "call_method"):
                node.args, a = _move_literal(node.args, device)
                kwargs = dict(node.kwargs)
                if isinstance(kwargs.get("device"), str):       # device="cpu" as a traced string
                    kwargs["device"] = torch.device(kwargs["device"])
                node.kwargs, k = _move_literal(kwargs, device)
                changed += int(a) + int(k)
        if changed != before:
            mod.recompile()
    for mod, name, value in list(lifted_constants(gm)):
        # a constant still on meta has no value to move: the loader fills it
        if value.device != device and (value.device.type != "meta" or device.type == "meta"):
            setattr(mod, name, value.to(device))
    return changed
