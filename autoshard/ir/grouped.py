"""The per-expert Linear the graph runs after :mod:`autoshard.passes.experts`.

``grouped_linear(x, w, offs, transposed, impl)`` is the grouped matmul it
replaced (``aten._grouped_mm`` or transformers' ``grouped_mm_fallback``) with the
parameter as a direct operand: rows ``offs[e-1]:offs[e]`` of ``x`` times expert
``e``'s weight. On a rank the weight is that rank's block of every expert; the
groups (token counts per expert) are whole.

    >>> import transformers.integrations.moe       # registers transformers::grouped_mm_fallback
    >>> x, w = torch.ones(3, 2), torch.arange(8.).view(2, 2, 2)       # 2 experts, [E, n, k]
    >>> grouped_linear(x, w, torch.tensor([1, 3]), True, "transformers")
    tensor([[ 1.,  5.],
            [ 9., 13.],
            [ 9., 13.]])
"""

from __future__ import annotations

import torch

__all__ = ["grouped_linear", "grouped_ops", "grouped_targets", "grouped_weight_dims", "run_impl"]


def grouped_ops() -> dict:
    """Grouped-matmul ops by name, read at call time (transformers registers its
    op when its MoE code is imported): ``op(x[S, k], w[E, k, n], offs[E]) -> [S, n]``."""
    ops = {}
    if hasattr(torch.ops.aten, "_grouped_mm"):
        ops["aten"] = torch.ops.aten._grouped_mm.default
    try:
        ops["transformers"] = torch.ops.transformers.grouped_mm_fallback.default
    except (AttributeError, RuntimeError):      # transformers' MoE code not imported
        pass
    return ops


def grouped_targets(folded: bool = False) -> frozenset:
    """The call targets a grouped matmul has in a graph: the ops of :func:`grouped_ops`,
    and :func:`grouped_linear` too with ``folded`` (a graph after
    :mod:`autoshard.passes.experts`).

    >>> grouped_linear in grouped_targets(folded=True), grouped_linear in grouped_targets()
    (True, False)
    """
    ops = frozenset(grouped_ops().values())
    return ops | {grouped_linear} if folded else ops


def run_impl(impl: str, device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None) -> str:
    """The grouped matmul to run for a node captured with ``impl``, on ``device_type`` in
    ``dtype`` (autocast's compute dtype, or the weight's): transformers' fallback (the
    one a float32 capture records, export being a compile) loops over the groups reading
    ``offs`` on the host, a stop of the GPU per expert layer, forward and backward; on a
    CUDA device of compute capability 8.0 or more in bfloat16, ``aten._grouped_mm`` (one
    kernel, no host read) computes the same products.

    >>> run_impl("transformers", "cuda", torch.bfloat16, (9, 0))
    'aten'
    >>> run_impl("transformers", "cpu", torch.bfloat16, None)
    'transformers'
    """
    if impl == "transformers" and device_type == "cuda" and dtype == torch.bfloat16 \
            and capability is not None and capability >= (8, 0) and hasattr(torch.ops.aten, "_grouped_mm"):
        return "aten"
    return impl


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, transposed: bool, impl: str) -> torch.Tensor:
    """``impl``'s grouped matmul of ``x`` with ``w`` (``[E, n, k]`` when ``transposed``,
    the stored per-expert ``nn.Linear`` layout, else ``[E, k, n]``) over the groups ``offs``
    (on a GPU in bfloat16: :func:`run_impl`'s, with the operands in that dtype, as autocast
    would cast them for the fallback's per-group products)."""
    if x.device.type == "cuda":
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else w.dtype
        run = run_impl(impl, "cuda", dtype, torch.cuda.get_device_capability(x.device))
        if run != impl:
            x, w = x.to(dtype), w.to(dtype)
            impl = run
    return grouped_ops()[impl](x, w.transpose(-2, -1) if transposed else w, offs)


def grouped_weight_dims(node) -> tuple[int, int]:
    """``(n_dim, k_dim)`` of a ``grouped_linear`` node's 3-D weight: output and input features."""
    return (1, 2) if node.args[3] else (2, 1)
