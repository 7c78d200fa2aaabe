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

__all__ = ["local_rank", "backend_for", "device_backends", "uses_cuda", "rank_device", "comm_device",
           "init_process_group", "bind_user_group", "check_model_device", "retarget", "lifted_constants",
           "on_device"]


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


def device_backends(backend: str | None = None) -> dict[str, str]:
    """Device type -> backend of a backend string, or of the default group's when None.

    torch names a group's backend by what was asked for: ``"nccl"``, ``"gloo"``,
    ``"cuda:nccl,cpu:gloo"``, or ``"undefined"`` for ``init_process_group()`` with no
    backend (then each device type gets its default, NCCL for CUDA where it is built).
    The configuration (``dist.get_backend_config``) says per device type what runs.

    >>> device_backends("cuda:nccl,cpu:gloo")
    {'cuda': 'nccl', 'cpu': 'gloo'}
    >>> device_backends("nccl")
    {'cuda': 'nccl'}
    """
    if backend is None:
        if not (dist.is_available() and dist.is_initialized()):
            return {}
        backend = dist.get_backend_config()
    backend = backend.lower()
    if ":" not in backend:      # one backend for the device types it serves
        return {"cuda": backend} if backend == "nccl" else {"cpu": backend, "cuda": backend}
    return dict(part.split(":", 1) for part in backend.split(",") if ":" in part)


def uses_cuda(backend: str | None = None) -> bool:
    """Whether a job on ``backend`` (default: the running group's) keeps its tensors on
    CUDA: CUDA is available and a backend other than gloo (which carries CPU tensors,
    and copies CUDA ones through the host) serves the ``cuda`` device type."""
    be = device_backends(backend).get("cuda")
    return be not in (None, "gloo", "undefined") and torch.cuda.is_available()


def rank_device(backend: str | None = None, environ: Mapping[str, str] | None = None) -> torch.device:
    """This rank's device under ``backend`` (default: the running group's, else
    :func:`backend_for`): ``cuda:LOCAL_RANK`` where the group carries CUDA tensors
    (:func:`uses_cuda`: ``"nccl"``, ``"cuda:nccl,cpu:gloo"``, ``init_process_group()``
    with no backend on a CUDA host), the CPU otherwise."""
    if backend is None and not (dist.is_available() and dist.is_initialized()):
        backend = backend_for()
    if uses_cuda(backend):
        return torch.device("cuda", local_rank(environ))
    return torch.device("cpu")


def comm_device() -> torch.device:
    """Where a tensor given to a collective of the default group must live: the
    current CUDA device where the group carries CUDA tensors (:func:`uses_cuda`), the
    CPU otherwise."""
    if dist.is_available() and dist.is_initialized() and uses_cuda():
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


def bind_user_group(environ: Mapping[str, str] | None = None) -> torch.device | None:
    """Make this rank's GPU current in a process group the caller created; returns it
    (None where the group carries CPU tensors).

    :func:`init_process_group` binds ``cuda:LOCAL_RANK`` before creating the group; a
    group made by the caller may not have: every rank's current device is then cuda:0
    and the first collective puts all ranks on GPU 0. The GPU is the one the group was
    bound to (``init_process_group(device_id=...)``), else the current device if the
    caller set one (not cuda:0), else ``cuda:LOCAL_RANK`` (torchrun sets it), else
    ``cuda:(rank % device_count)``. A rank that would share a GPU with another on its
    node (``LOCAL_RANK`` past its GPUs) is refused before any collective."""
    if not uses_cuda():
        return None
    from ..ir.errors import ConfigError

    env = os.environ if environ is None else environ
    n, rank = torch.cuda.device_count(), dist.get_rank()
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    cur = torch.cuda.current_device()
    if bound is not None:
        want = bound.index if bound.index is not None else cur
    elif cur != 0:
        want = cur                          # the caller's own choice
    elif "LOCAL_RANK" in env:
        want = local_rank(env)
        if want >= n:
            raise ConfigError(f"LOCAL_RANK={want} but this node has {n} GPU(s) (cuda:0..cuda:{n - 1}): start at "
                              f"most {n} processes per node, or torch.cuda.set_device() on each rank before shard()")
    else:
        want = rank % n                     # one visible GPU per process (CUDA_VISIBLE_DEVICES): cuda:0
    dev = torch.device("cuda", want)
    if want != cur:
        torch.cuda.set_device(dev)
    return dev


def check_model_device(model: torch.nn.Module, device: torch.device) -> None:
    """Warn when ``model``'s parameters sit on a GPU: ``shard()`` keeps only this rank's
    slices on ``device``, but a model moved with ``.cuda()`` first holds a full copy per
    rank on its GPU (on cuda:0 for every rank when no device was set), which the
    sharded module does not free."""
    on = sorted({str(p.device) for p in model.parameters() if p.device.type == "cuda"})
    if not on:
        return
    from ..ir.errors import AutoshardWarning
    from ..ir.log import warn

    where = "this rank's own GPU" if on == [str(device)] else f"{', '.join(on)}, not this rank's device {device}"
    warn(f"the model's parameters are on {where}: every rank then holds a full copy of the model there, and "
         f"shard() keeps only its slices. Build or load the model on the CPU (or on meta, with weights=) "
         f"and let shard() place the slices; call .cuda() on the sharded module, not before", AutoshardWarning,
         stacklevel=3)


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


def on_device(kwargs: dict, device: torch.device) -> dict:
    """``kwargs`` with every tensor on ``device`` (no copy where it is there already).

    >>> on_device({"x": torch.ones(1), "n": 3}, torch.device("cpu"))["n"]
    3
    """
    return {k: v.to(device) if isinstance(v, torch.Tensor) and v.device != device else v for k, v in kwargs.items()}
