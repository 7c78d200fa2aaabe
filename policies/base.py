"""What a policy returns, and the small interface every mode implements.

A rule looks at one node through a read-only context (``ctx``) given by the
propagate pass and returns a :class:`Choice`: the spec each tensor input must
have (the pass inserts the re-layout), the spec of the output, and for heavy
ops the kernel to run and its collectives. Policies import no pass and nothing
that touches ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autoshard.errors import ConfigError
from autoshard.mesh import Mesh
from autoshard.plan import Step
from autoshard.spec import ShardSpec

__all__ = ["Choice", "KComm", "Policy", "NeedReplicate"]


@dataclass(frozen=True)
class KComm:
    """A collective inside a kernel: ``numel`` elements of the full buffer."""

    phase: str
    kind: str
    axes: tuple[str, ...]
    numel: int
    needs_grad_of: tuple = ()   # bwd comm happens only if one of these input paths needs grad


@dataclass
class Choice:
    out: Any                                              # ShardSpec | tuple | None
    inputs: dict = field(default_factory=dict)            # arg path -> required ShardSpec
    kernel: str | None = None
    kernel_args: dict = field(default_factory=dict)
    post: tuple[Step, ...] = ()
    patches: dict = field(default_factory=dict)           # arg path -> new literal
    comms: tuple[KComm, ...] = ()
    grad_complete: frozenset = frozenset()                # input paths whose grads the kernel completes
    param_sync: dict = field(default_factory=dict)        # arg path -> axes (explicit; overrides generic rule)
    notes: tuple[str, ...] = ()
    fallback: bool = False
    weight: str = ""


class NeedReplicate(Exception):
    """Raised by a rule when an input split cannot pass; carries the input path and dim."""

    def __init__(self, path, dim: int, reason: str):
        super().__init__(reason)
        self.path, self.dim, self.reason = path, dim, reason


class Policy:
    """Interface of a mode. Subclasses set ``name`` and implement ``make_mesh``,
    ``linear`` and ``embedding``; norms, attention and the loss follow the specs."""

    name: str = ""
    tp_axes: tuple[str, ...] = ()
    batch_axes: tuple[str, ...] = ()

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    @classmethod
    def make_mesh(cls, world_size: int, *, depth: int | None = None, dp: int = 1) -> Mesh:
        raise NotImplementedError

    @staticmethod
    def _check_dp(world_size: int, dp: int) -> int:
        if dp < 1 or world_size % dp:
            raise ConfigError(f"dp={dp} must divide the world size {world_size}; "
                              f"valid dp: {[d for d in range(1, world_size + 1) if world_size % d == 0]}")
        return world_size // dp

    def linear(self, ctx) -> Choice:
        raise NotImplementedError

    def embedding(self, ctx) -> Choice:
        raise NotImplementedError


def spec_of(ndim: int, **dims) -> ShardSpec:
    d = [()] * ndim
    for k, v in dims.items():
        d[int(k[1:])] = v
    return ShardSpec(dims=tuple(d))


def tied_head_choice(ctx, xp, wp, bp, rows, rseg, col: tuple[str, ...], ws: ShardSpec, q: int) -> Choice:
    """A Linear that reuses an embedding table split on hidden over ``col``
    (tied LM head): ``x·Eᵀ`` is partial over ``col`` and reduce-scattered on vocab.

    ``rows``/``rseg`` give the token dims' layout of ``x``; the output keeps them
    and splits the vocabulary over ``col``."""
    xreq = ShardSpec(dims=rows + (col,), segments=rseg + (1,))
    ins = {xp: xreq, wp: ws}
    if bp:
        ins[bp] = ShardSpec(dims=(col,))
    out = ShardSpec(dims=rows + (col,), segments=rseg + (1,))
    full = ctx.local_numel(ctx.node, out) * q
    label = ",".join(col)
    return Choice(out=out, inputs=ins, kernel="partial_head",
                  kernel_args={"col_axes": list(col), "n_dim": 0, "bias": list(bp) if bp else None},
                  comms=(KComm("fwd", "reduce_scatter", col, full), KComm("bwd", "all_gather", col, full, (xp, wp))),
                  weight=f"tied table [vocab, hidden/{q} over {label}]",
                  notes=(f"x·Eᵀ partial over {label}, reduce-scattered on vocab",))
