"""autoshard: automatic 1D / 2D / 2.5D tensor parallelism for Hugging Face models.

One call captures a model as a graph, plans how every node is split over a
device mesh, and rewrites it into a trainable distributed module::

    import autoshard
    autoshard.plan(config, world_size=64, mode="2.5d", depth=4).show()   # no processes
    sharded = autoshard.shard(model, mode="1d")                          # under torchrun

The names below are resolved on first use (PEP 562), so ``import autoshard`` or
``import autoshard.ir.spec`` loads neither ``torch.distributed`` nor ``transformers``.
"""

from __future__ import annotations

import importlib
import sys
import types

# public name -> the module that defines it
_WHERE = {
    "shard": "api", "plan": "api", "MODES": "api", "verify": "verification", "VerifyReport": "verification",
    "from_pretrained": "load", "load_checkpoint": "load", "export_checkpoint": "io.export",
    "CommLedger": "runtime.collectives",
    "CLUSTERS": "planning.cost", "Cluster": "planning.cost", "estimate": "planning.cost", "profile": "planning.profile",
    "AutoshardError": "ir.errors", "CaptureError": "ir.errors", "CheckpointError": "ir.errors", "ConfigError": "ir.errors",
    "ShardingError": "ir.errors", "CollectiveError": "ir.errors",
    "Mesh": "ir.mesh",
    "ShardedModule": "module",
    "ShardingPlan": "ir.plan",
    "search": "planning.search",
    "ShardSpec": "ir.spec",
}

__all__ = ["shard", "plan", "verify", "VerifyReport", "from_pretrained", "load_checkpoint", "export_checkpoint", "MODES", "Mesh", "ShardSpec", "ShardingPlan",
           "ShardedModule", "CommLedger",
           "search", "profile", "estimate", "Cluster", "CLUSTERS",
           "AutoshardError", "ConfigError", "ShardingError", "CaptureError", "CheckpointError", "CollectiveError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'autoshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value          # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
