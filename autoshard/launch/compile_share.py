"""Compile once per host, not once per rank.

Every rank of a plan runs the same graph: the rewrite names each rank's process
groups by a rank-independent alias (:func:`~autoshard.runtime.groups.group_alias`)
and, while ``torch.compile`` traces, the kernels read their rank from a graph op
(:func:`~autoshard.runtime.collectives.group_rank`) instead of folding it in as a
constant. So the graph dynamo hands its backend is one program on every rank, and
inductor's FX graph cache (on disk under ``TORCHINDUCTOR_CACHE_DIR``, which the ranks
of one host share) keys its forward and backward alike on every rank.

:class:`HostShared` wraps the backend :meth:`autoshard.ShardedModule.compile` uses:
the lowest rank of each host compiles each graph first; the host's other ranks
trace it meanwhile (dynamo, AOTAutograd) and wait on the rendezvous store before
inductor's code generation, which is then a hit in the cache (a load, not a
compile). The ranks stop competing for the host's cores with one code generation
each, which pays where a host runs more ranks than it has cores (the default:
only there). No collective is involved; a rank whose graph differs
from its leader's (compared by a digest of the code and the inputs' metadata), a
leader that does not announce its graph within ``announce_s`` or does not finish
within ``AUTOSHARD_TIMEOUT``, all compile by themselves: sharing can cost a wait,
never a result. Only ``inductor`` has the caches; other backends are not wrapped.
See docs/design.md, "Compiling once per host".

    >>> backend = HostShared.for_compile({"backend": "inductor"})   # no process group: plain inductor
    >>> backend is None
    True
"""

from __future__ import annotations

import hashlib
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..runtime.timeout import timeout_seconds

__all__ = ["HostShared", "graph_digest"]

_STATE: dict = {}      # per default process group: the host's leader rank, graphs compiled so far


def graph_digest(gm: torch.fx.GraphModule, example_inputs) -> str:
    """A digest of what inductor's caches key a graph by, as far as it differs between
    ranks: the graph's code, its attributes' and the example inputs' metadata."""
    h = hashlib.sha256(gm.code.encode())
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.device}:{t.requires_grad}".encode())
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            h.update(f"T{tuple(x.shape)}:{x.stride()}:{x.dtype}:{x.device}:{x.requires_grad}".encode())
        else:
            h.update(f"V{x!r}".encode())
    return h.hexdigest()


def _wait(store, key: str, seconds: float) -> bool:
    """Whether ``key`` appeared in the store within ``seconds``. Polled, not
    ``store.wait``: a blocked wait holds the process's store connection, and the
    heartbeat thread (:mod:`autoshard.runtime.heartbeat`) would miss its beats."""
    deadline = time.monotonic() + seconds
    pause = 0.005
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(0.1, pause * 2)
    return True


class HostShared:
    """A ``torch.compile`` backend: ``inner`` (inductor's), the host's lowest rank first.

    ``share``: True always shares, None (auto) shares where a host has more ranks than
    its lowest rank has cores (there the ranks' compiles compete for the cores; where
    each rank has a core, one compile after another is slower than all at once).
    ``announce_s``: how long a rank waits for its leader to announce the same graph
    before it compiles alone (the leader runs the same code, so it is seconds behind
    at most). Built by :meth:`for_compile`; used by :meth:`autoshard.ShardedModule.compile`.
    """

    def __init__(self, inner, share: bool | None = None, announce_s: float = 60.0):
        self.inner = inner
        self.share = share
        self.announce_s = float(announce_s)
        self.shared = 0        # graphs this rank compiled after its leader (cache hits expected)
        self.alone = 0         # graphs it compiled by itself (a leader, not sharing, or no graph to follow)

    @classmethod
    def for_compile(cls, kwargs: dict, share: bool | None = None) -> "HostShared | None":
        """The shared backend for ``torch.compile(**kwargs)`` (``kwargs``' ``mode`` and
        ``options`` go into it, as ``torch.compile`` builds its inductor backend), or None
        where sharing cannot pay: another backend than inductor (no cache to share), no
        process group, one rank."""
        if kwargs.get("backend", "inductor") not in (None, "inductor") or (kwargs.get("options") or {}).get("use_aoti"):
            return None
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        inner = torch._TorchCompileInductorWrapper(kwargs.get("mode"), kwargs.get("options"), kwargs.get("dynamic"))
        return cls(inner, share)

    def _compile(self, gm, example_inputs, after: str | None = None):
        """``inner`` on the graph, its backward compiled now (not at the first backward
        call: the leader's "done" then covers both graphs). ``after``: a store key to
        wait for first — only before inductor's code generation where ``inner`` is
        inductor's (this rank's dynamo and AOTAutograd trace meanwhile), else before all."""
        import torch._functorch.config as aot_config

        with aot_config.patch(force_non_lazy_backward_lowering=True):
            if after is None:
                return self.inner(gm, example_inputs)
            config = getattr(self.inner, "config", None)
            if not isinstance(config, dict):
                _wait(c10d._get_default_store(), after, timeout_seconds())
                return self.inner(gm, example_inputs)
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            def inner_compile(graph, inputs, **kw):     # forward, then backward
                _wait(c10d._get_default_store(), after, timeout_seconds())
                return compile_fx_inner(graph, inputs, **kw)

            return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=dict(config))

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        store = c10d._get_default_store()
        state = _host_state(store)
        if state["alone"] or not (state["crowded"] if self.share is None else self.share):
            self.alone += 1
            return self.inner(gm, example_inputs)
        rank, leader = dist.get_rank(), state["leader"]
        n = state["graphs"]
        state["graphs"] = n + 1
        key = f"autoshard/compile/{leader}/{n}"
        digest = graph_digest(gm, example_inputs)
        if rank == leader:
            store.set(key, digest)
            try:
                self.alone += 1
                return self._compile(gm, example_inputs)
            finally:
                store.set(f"{key}/done", "1")     # a failed compile too: the others compile and fail alike
        if not _wait(store, key, self.announce_s) or store.get(key).decode() != digest:
            self.alone += 1
            return self._compile(gm, example_inputs)
        self.shared += 1
        return self._compile(gm, example_inputs, after=f"{key}/done")


def _host_state(store) -> dict:
    """This process's host facts for the current default group, gathered on its first
    compile: its host's leader (the lowest rank that reported this host name), whether
    the host runs more ranks than its leader has cores (``crowded``), whether it runs
    this rank only (``alone``), and the graphs shared so far. Every rank reports its
    host and cores through the store; a rank that cannot read them all within a
    minute compiles alone."""
    world = id(dist.group.WORLD)
    state = _STATE.get(world)
    if state is not None:
        return state
    rank, size = dist.get_rank(), dist.get_world_size()
    prefix = "autoshard/compile/host/"
    store.set(f"{prefix}{rank}", f"{len(os.sched_getaffinity(0))} {socket.gethostname()}")
    keys = [f"{prefix}{r}" for r in range(size)]
    deadline = time.monotonic() + 60.0
    state = {"leader": rank, "graphs": 0, "alone": True, "crowded": False}
    if all(_wait(store, k, max(0.01, deadline - time.monotonic())) for k in keys):
        reports = [store.get(k).decode().split(" ", 1) for k in keys]
        hosts = [h for _, h in reports]
        here = hosts.count(hosts[rank])
        leader = hosts.index(hosts[rank])
        state.update(leader=leader, alone=here == 1, crowded=here > int(reports[leader][0]))
    _STATE.clear()
    _STATE[world] = state
    return state
