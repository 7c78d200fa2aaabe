"""What one launch of :func:`autoshard.shard` ends in, whichever way it went.

``shard()`` reaches a rank's rewritten graph in one of two ways: the full pipeline
(capture, plan, rewrite) or a launch-cache hit (:mod:`.launch_cache` rebuilds the graph
from the rank's entry). Both end in a :class:`Launched`, and the
:class:`~autoshard.module.ShardedModule` is built from it alone, so a relaunch cannot
differ from a first launch in anything the record does not carry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import fx

from ..ir.plan import ShardingPlan
from ..ir.signature import batch_inputs, pad_blocker
from ..policies.base import Policy

__all__ = ["LaunchFacts", "Launched", "non_persistent_buffers", "mark_non_persistent"]


@dataclass(frozen=True, kw_only=True)
class LaunchFacts:
    """What the module needs to know of the capture, which a relaunch does not make.

    Attributes:
        mode: the layout's policy name (``"1d"``, ``"2d"``, ...; ``mode="auto"``: the one chosen).
        input_names: the keyword arguments the graph takes, in order.
        constants: non-tensor keyword arguments baked into the graph (``use_cache=False``).
        example_inputs: the inputs the graph was captured with (their signature keys the graph).
        training: whether the model was captured in train mode.
        seq_range: ``(lo, hi)`` sequence lengths export proved the graph for.
        guards: what export built the graph's input guards from (rebuilt on a relaunch).
        batch_inputs: the inputs whose first dim is the batch (padded when it does not divide).
        pad_blocker: why padding the batch would not be exact, or None.
        batch_size: the global batch the plan was made for.
        seq_len: the sequence length the plan was made for.
        non_persistent: the paths of the buffers ``state_dict()`` leaves out (the model's
            ``register_buffer(..., persistent=False)``: rotary tables and the like).
    """

    mode: str
    input_names: tuple
    constants: dict
    example_inputs: dict
    training: bool
    seq_range: tuple
    guards: tuple
    batch_inputs: frozenset
    pad_blocker: str | None
    batch_size: int
    seq_len: int
    non_persistent: frozenset = frozenset()

    @classmethod
    def of_capture(cls, cap, gm: fx.GraphModule, *, mode: str, batch_size: int, seq_len: int) -> "LaunchFacts":
        """The facts of capture ``cap`` planned under policy ``mode`` and rewritten into ``gm``."""
        return cls(mode=mode, input_names=tuple(cap.input_names), constants=dict(cap.constants),
                   example_inputs=cap.example_inputs, training=cap.training, seq_range=tuple(cap.seq_range),
                   guards=cap.guards, batch_inputs=frozenset(batch_inputs(cap.module, cap.batch_symbol)),
                   pad_blocker=pad_blocker(cap.module, cap.batch_symbol), batch_size=batch_size, seq_len=seq_len,
                   non_persistent=non_persistent_buffers(gm))

    def to_dict(self) -> dict:
        """The facts as plain data (what a launch-cache entry keeps: no class to unpickle)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "LaunchFacts":
        """The facts :meth:`to_dict` wrote."""
        return cls(**d)


@dataclass(frozen=True, kw_only=True)
class Launched:
    """One rank's launch: its rewritten graph and everything the module is built from.

    Attributes:
        gm: this rank's rewritten graph module (parameters sliced; no weights callback yet).
        plan: the sharding plan ``gm`` was rewritten under.
        policy: the layout's policy (``mode="auto"``: the one chosen).
        groups: axes label -> process-group name, this launch's.
        facts: what the capture said (:class:`LaunchFacts`).
        from_cache: True where the launch cache rebuilt ``gm`` (no capture, no planning).
    """

    gm: fx.GraphModule
    plan: ShardingPlan
    policy: Policy
    groups: dict
    facts: LaunchFacts
    from_cache: bool = False


def non_persistent_buffers(gm: fx.GraphModule) -> frozenset:
    """The paths of ``gm``'s buffers that ``state_dict()`` leaves out."""
    kept = set(gm.state_dict(keep_vars=True))
    return frozenset(name for name, _ in gm.named_buffers(remove_duplicate=False) if name not in kept)


def mark_non_persistent(gm: fx.GraphModule, names) -> None:
    """Register each buffer of ``names`` again as non-persistent (in place): a module
    rebuilt tensor by tensor would otherwise put them in its ``state_dict``."""
    for name in names:
        path, _, attr = name.rpartition(".")
        mod = gm.get_submodule(path) if path else gm
        mod.register_buffer(attr, gm.get_buffer(name), persistent=False)
