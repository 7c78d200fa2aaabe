"""autoshard: automatic 1D / 2D / 2.5D tensor parallelism for Hugging Face models.

One call captures a model as a graph, plans how every node is split over a
device mesh, and rewrites it into a trainable distributed module::

    import autoshard
    autoshard.plan(config, world_size=64, mode="2.5d", depth=4).show()   # no processes
    sharded = autoshard.shard(model, mode="1d")                          # under torchrun
"""

from .api import MODES, plan, shard
from .load import from_pretrained, load_checkpoint
from .collectives import CommLedger
from .cost import CLUSTERS, Cluster, estimate, profile
from .errors import AutoshardError, CaptureError, CheckpointError, ConfigError, ShardingError
from .mesh import Mesh
from .module import ShardedModule
from .plan import ShardingPlan
from .search import search
from .spec import ShardSpec

__all__ = ["shard", "plan", "from_pretrained", "load_checkpoint", "MODES", "Mesh", "ShardSpec", "ShardingPlan",
           "ShardedModule", "CommLedger",
           "search", "profile", "estimate", "Cluster", "CLUSTERS",
           "AutoshardError", "ConfigError", "ShardingError", "CaptureError", "CheckpointError"]
__version__ = "0.1.0"
