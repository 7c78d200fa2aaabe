"""The runtime of the kernel objects (:mod:`autoshard.ir.kernels`) and the re-layout steps.

Each is a plain function of local tensors and c10d group names (or shape-only
groups on meta); collectives go through :mod:`autoshard.runtime.collectives` so the
ledger sees them. Which collectives each issues is declared by its kernel
object's ``comms``; the ledger tests hold the two together.

The kernels live in :mod:`autoshard.runtime.kernels`, one module per kind (the
shared steps and wire casts, Linears, vocabulary-parallel embedding and loss, norms,
dropout, attention); this module binds each kernel class to its function
(:func:`bind`) and is where the rewrite and the passes name them
(``parallel_ops.step``, ``parallel_ops.row_linear``, ...).
"""

from __future__ import annotations

from ..ir import kernels as K
from .kernels.attention import attention_dropout, ring_attention, ring_work, sequence_conv
from .kernels.common import AUTOCAST_PRODUCTS, paired_collectives, step
from .kernels.dropout import dropout, dropout_active
from .kernels.linear import gather_weight_start, gathered_linears, partial_head, row_linear, summa, three_d
from .kernels.norm import dist_layer_norm, sync_batch_norm
from .kernels.vocab import cross_entropy, vocab_embedding

__all__ = ["bind", "step", "AUTOCAST_PRODUCTS", "casting_kernels", "row_linear", "summa", "three_d", "partial_head", "vocab_embedding",
           "dist_layer_norm", "sync_batch_norm",
           "cross_entropy", "dropout", "dropout_active", "attention_dropout", "paired_collectives",
           "gather_weight_start", "gathered_linears", "ring_attention", "ring_work", "sequence_conv"]


# The implementation of each kernel class of autoshard.ir.kernels: the IR says what a
# kernel needs (Kernel.call_args), this table says what runs it.
_IMPLEMENTATIONS = {
    K.RowLinear: row_linear, K.Summa: summa, K.ThreeDLinear: three_d, K.PartialHead: partial_head,
    K.VocabEmbedding: vocab_embedding, K.DistLayerNorm: dist_layer_norm, K.SyncBatchNorm: sync_batch_norm,
    K.CrossEntropy: cross_entropy,
    K.Dropout: dropout, K.AttentionDropout: attention_dropout, K.RingAttention: ring_attention,
    K.SequenceConv: sequence_conv,
}


def casting_kernels() -> frozenset:
    """The kernels that cast their operands to autocast's compute dtype before they gather
    them (a value only they read may be cast before an earlier gather too)."""
    return frozenset((row_linear, summa, three_d, partial_head, gathered_linears))


def bind(kernel: K.Kernel, node, group, size) -> tuple:
    """``(function, args, kwargs)`` computing ``node`` with ``kernel``: the function
    registered for its class (the nearest base class that has one) with the
    arguments the kernel names (:meth:`~autoshard.ir.kernels.Kernel.call_args`)."""
    for cls in type(kernel).__mro__:
        fn = _IMPLEMENTATIONS.get(cls)
        if fn is not None:
            args, kwargs = kernel.call_args(node, group, size)
            return fn, args, kwargs
    raise TypeError(f"no runtime implementation for kernel {type(kernel).__name__}; "
                    f"registered: {sorted(c.__name__ for c in _IMPLEMENTATIONS)}")
