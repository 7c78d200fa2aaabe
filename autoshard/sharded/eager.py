"""The eager graph passes a sharded module runs its graphs through when it is not
compiled: weight prefetching (:mod:`autoshard.passes.prefetch`, after
:meth:`~autoshard.module.ShardedModule.prefetch_weights`) and asynchronous row-parallel
Linears (:mod:`autoshard.passes.async_tp`, after
:meth:`~autoshard.module.ShardedModule.async_tp`), one rewritten copy per graph."""

from __future__ import annotations

from ..ir.errors import ConfigError

__all__ = ["EagerPasses", "check_chunks"]


def check_chunks(chunks) -> None:
    """Refuse an ``async_tp`` chunk count that is not a whole number >= 1."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ConfigError(f"async_tp(chunks={chunks!r}): a whole number of row blocks >= 1 (1 turns it off; "
                          f"2 is the usual choice)")


class EagerPasses:
    """Which eager passes are on, and each graph's copy with them applied."""

    def __init__(self) -> None:
        self.prefetch = False       # prefetch_weights(): each weight gather launched one Linear early
        self.chunks = 1             # async_tp(chunks): row blocks per row-parallel Linear (1: off)
        self._copies: dict = {}     # id(graph) -> its copy with the passes applied

    @property
    def on(self) -> bool:
        """Whether any pass is on."""
        return self.prefetch or self.chunks > 1

    def set_prefetch(self, on: bool) -> None:
        """Turn weight prefetching on or off (the copies are made again)."""
        self.prefetch, self._copies = bool(on), {}

    def set_chunks(self, chunks: int) -> None:
        """Pipeline each row-parallel Linear in ``chunks`` blocks (1: off; the copies are made again)."""
        check_chunks(chunks)
        self.chunks, self._copies = chunks, {}

    def graph(self, g):
        """What runs for graph ``g``: its graph module, or its copy with the passes on."""
        if not self.on:
            return g.gm
        if id(g) not in self._copies:
            self._copies[id(g)] = self.apply(g.gm)
        return self._copies[id(g)]

    def apply(self, gm):
        """``gm`` with the passes that are on: weight prefetching, then asynchronous
        row-parallel Linears."""
        if self.prefetch:
            from ..passes.prefetch import prefetch_weights

            gm = prefetch_weights(gm)[0]
        if self.chunks > 1:
            from ..passes.async_tp import async_row_linears

            gm = async_row_linears(gm, self.chunks)[0]
        return gm

    def reset(self) -> None:
        """Forget the copies (made for the old device)."""
        self._copies = {}
