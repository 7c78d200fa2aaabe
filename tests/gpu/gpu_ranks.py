"""Run a function on one NCCL rank per GPU, as torchrun would start them.

Each rank gets ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` /
``MASTER_PORT`` and joins the job through autoshard's own device rule (the first
``autoshard.shard`` call does it: ``set_device(cuda:LOCAL_RANK)``, then
``init_process_group("nccl", device_id=...)``), so the tests exercise the path a
user's ``torchrun`` job takes.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.backends.cuda.matmul.allow_tf32 = False        # fp32 comparisons with the dense model
    torch.backends.cudnn.allow_tf32 = False
    try:
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:           # noqa: BLE001 - reported to the test with its traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_gpus(fn, *args, world: int | None = None, timeout: float = 300.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` (default: every GPU) NCCL ranks; the
    results by rank, or a RuntimeError with every failing rank's traceback."""
    world = world or torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]
