"""The rendezvous of ranks forked by one parent (``autoshard verify``'s ranks): a store
whose port rank 0 binds when the ranks start and hands the others through a folder."""

from __future__ import annotations

import datetime
import os
import time

__all__ = ["folder_store"]


def folder_store(rank: int, world: int, folder: str, timeout: datetime.timedelta):
    """The ranks' rendezvous store. Rank 0 binds a port the OS picks at that moment and
    writes it to ``FOLDER/port``; the others read it. A port picked ahead (when the
    server starts, seconds before the ranks) could be taken meanwhile by a socket of
    another job on the host, gloo's own pairs included (the suspected cause of a rank losing
    its store connection mid-run, "Broken pipe", twice under a loaded full test run).

        >>> import datetime, tempfile
        >>> store = folder_store(0, 1, tempfile.mkdtemp(), datetime.timedelta(seconds=30))
        >>> store.port > 0
        True
    """
    import torch.distributed as dist

    path = os.path.join(folder, "port")
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        with open(path + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(path + ".tmp", path)
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 wrote no store port to {path} within {timeout.total_seconds():.0f} s")
        time.sleep(0.02)
    with open(path) as f:
        port = int(f.read())
    return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
