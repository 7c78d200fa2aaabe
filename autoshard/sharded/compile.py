"""``torch.compile`` on a sharded module: :meth:`~autoshard.module.ShardedModule.compile`'s
settings and the graphs it compiled (:class:`Compiler`), the CUDA-graph modes refused
(they replay each collective outside c10d's and the ledger's accounting), and the
batch and sequence dims marked dynamic for ``compile(dynamic=True)``."""

from __future__ import annotations

import torch

from ..ir.errors import ConfigError
from ..launch.compile_share import HostShared

try:        # whether dynamo traces the frames the caller calls (torch.compile(sharded) runs forward eagerly)
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as eval_frame_callback
except ImportError:     # another torch: the graph as it is (dynamo recompiles at a new length)
    def eval_frame_callback():
        """None: this torch has no frame callback to read."""
        return None

__all__ = ["Compiler", "CUDAGRAPHS_REFUSED", "cudagraphs_on", "eval_frame_callback", "mark_dynamic"]

CUDAGRAPHS_REFUSED = ("{what} captures CUDA graphs, which record each collective once and replay it outside "
                      "c10d's and autoshard's accounting (and a communicator's error handling); valid choices: "
                      "sharded.compile() or torch.compile(sharded) with mode='default' or "
                      "'max-autotune-no-cudagraphs' and no 'triton.cudagraphs' option")


def cudagraphs_on(callback) -> bool:
    """Whether the torch.compile running ``callback`` (dynamo's frame callback) was asked for
    CUDA graphs (``mode="reduce-overhead"`` / ``"max-autotune"`` set inductor's
    ``triton.cudagraphs``): the backend is found down the wrappers' ``_torchdynamo_orig_backend``."""
    for _ in range(6):
        if callback is None or callback is False:
            return False
        config = getattr(callback, "config", None)
        if isinstance(config, dict) and config.get("triton.cudagraphs"):
            return True
        callback = getattr(callback, "_torchdynamo_orig_backend", None)
    return False


class Compiler:
    """What :meth:`~autoshard.module.ShardedModule.compile` asked for and built: the
    ``torch.compile`` keywords, the host-shared backend, one compiled function per graph,
    and each graph's copy with its grad-mode blocks inlined (also what
    ``torch.compile(sharded)`` traces)."""

    def __init__(self) -> None:
        self._kw: dict | None = None     # set by configure(): the graphs run through torch.compile
        self.backend = None              # configure(): its HostShared backend (inductor on ranks)
        self.dynamic_dims = False        # compile(dynamic=True): batch and sequence dims marked dynamic
        self._fns: dict = {}             # id(graph) -> its torch.compile'd copy
        self._copies: dict = {}          # id(graph) -> its copy for torch.compile (grad-mode blocks inlined)

    @property
    def on(self) -> bool:
        """Whether the graphs run compiled (after :meth:`configure`)."""
        return self._kw is not None

    def configure(self, once_per_host: bool | None, kwargs: dict) -> None:
        """Take ``compile()``'s arguments (refusing the CUDA-graph modes); the graphs
        compile again on their next call."""
        if kwargs.get("mode") in ("reduce-overhead", "max-autotune"):
            # both capture CUDA graphs, which would record each c10d call once and replay it
            # without the ledger or the communicator seeing a new call
            raise ConfigError(f"compile(mode={kwargs['mode']!r}) captures CUDA graphs, which replay the collectives "
                              f"outside c10d's and autoshard's accounting; valid choices: mode='default' or "
                              f"'max-autotune-no-cudagraphs'")
        if (kwargs.get("options") or {}).get("triton.cudagraphs"):
            raise ConfigError(CUDAGRAPHS_REFUSED.format(what="compile(options={'triton.cudagraphs': True})"))
        self.dynamic_dims = kwargs.get("dynamic") is True
        self._kw = {k: v for k, v in kwargs.items() if not (k == "dynamic" and v is True)}
        self.backend = None if once_per_host is False else HostShared.for_compile(self._kw, once_per_host)
        self._fns = {}

    def compiled(self, g):
        """``g``'s graph through ``torch.compile``, compiled once per graph."""
        fn = self._fns.get(id(g))
        if fn is None:
            gm = self.copy(g)
            kw = self._kw
            if self.backend is not None:      # inductor, the host's first rank first
                kw = {k: v for k, v in kw.items() if k not in ("backend", "mode", "options")}
                kw["backend"] = self.backend
            fn = self._fns[id(g)] = torch.compile(gm, **kw)
        return fn

    @torch.compiler.disable
    def copy(self, g):
        """``g``'s graph as ``torch.compile`` takes it: its grad-mode blocks inlined
        (:mod:`autoshard.passes.grad_blocks`: dynamo breaks at them with a dynamic
        size), one copy per graph."""
        gm = self._copies.get(id(g))
        if gm is None:
            from ..passes.grad_blocks import inline_grad_blocks

            gm = self._copies[id(g)] = inline_grad_blocks(g.gm)
        return gm

    def drop_copies(self) -> None:
        """Forget the graphs' copies (their graphs changed: ``split_blocks()``)."""
        self._copies = {}

    def reset(self) -> None:
        """Forget everything built for the old device (compiled functions and copies)."""
        self._fns, self._copies = {}, {}


@torch.compiler.disable
def mark_dynamic(g, full: dict) -> dict:
    """``full`` with its batch and sequence dims marked dynamic where ``g`` keeps them
    symbolic (``maybe_mark_dynamic``: dynamo may still specialise one), so that the
    first compile is the one for every size (``compile(dynamic=True)``). The marks go on views: the caller's
    tensors stay unmarked for whatever else it compiles."""
    import torch._dynamo

    dims = {name: d for name, _, d in g.signature.tensors}
    batch, seq = g.static_batch is None, not g.static_seq
    out = dict(full)
    for name, t in full.items():
        marks = [i for i, d in enumerate(dims.get(name, ()) if isinstance(t, torch.Tensor) else ())
                 if (d == "b" and batch) or (d == "s" and seq)]
        if marks:
            out[name] = t.view_as(t)
            for i in marks:
                torch._dynamo.maybe_mark_dynamic(out[name], i)
    return out
