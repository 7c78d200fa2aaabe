"""Training a sharded module: the loop, clipping, checkpoints of a run
(:mod:`.train`), ZeRO-1/2 over the dp axis (:mod:`.zero`) and
``transformers.Trainer`` on a sharded module (:mod:`.trainer`). This layer sits on
top of the face (it trains a :class:`~autoshard.module.ShardedModule`).
"""
