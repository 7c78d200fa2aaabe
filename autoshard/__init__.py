"""autoshard: automatic 1D / 2D / 2.5D tensor parallelism for Hugging Face models.

One call captures a model as a graph, plans how every node is split over a
device mesh, and rewrites it into a trainable distributed module::

    import autoshard
    autoshard.plan(config, world_size=64, mode="2.5d", depth=4).show()   # no processes
    sharded = autoshard.shard(model, mode="1d")                          # under torchrun

The names below are resolved on first use (PEP 562), so ``import autoshard`` or
``import autoshard.spec`` loads neither ``torch.distributed`` nor ``transformers``.
"""

from __future__ import annotations

import importlib
import sys
import types

# public name -> the module that defines it
_WHERE = {
    "shard": "api", "plan": "api", "MODES": "api",
    "from_pretrained": "load", "load_checkpoint": "load", "export_checkpoint": "export",
    "CommLedger": "collectives",
    "CLUSTERS": "cost", "Cluster": "cost", "estimate": "cost", "profile": "cost",
    "AutoshardError": "errors", "CaptureError": "errors", "CheckpointError": "errors", "ConfigError": "errors",
    "ShardingError": "errors", "CollectiveError": "errors",
    "Mesh": "mesh",
    "ShardedModule": "module",
    "ShardingPlan": "plan",
    "search": "search",
    "ShardSpec": "spec",
}

__all__ = ["shard", "plan", "from_pretrained", "load_checkpoint", "export_checkpoint", "MODES", "Mesh", "ShardSpec", "ShardingPlan",
           "ShardedModule", "CommLedger",
           "search", "profile", "estimate", "Cluster", "CLUSTERS",
           "AutoshardError", "ConfigError", "ShardingError", "CaptureError", "CheckpointError", "CollectiveError"]
__version__ = "0.1.0"


# ``plan`` and ``search`` are both public functions and submodules; importing the
# submodule would make the package attribute the module, so it is not stored
# (the function is resolved through __getattr__, as it was by the eager import).
_SHADOWED = {"plan", "search"}


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'autoshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value          # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
