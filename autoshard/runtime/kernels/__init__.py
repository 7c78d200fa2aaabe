"""The parallel kernels, one module per kind: :mod:`.common` (the re-layout steps,
autocast's wire dtype, fused segments, paired collectives), :mod:`.linear` (row-parallel,
SUMMA, 3D, the partial head), :mod:`.vocab` (vocabulary-parallel embedding and
cross-entropy), :mod:`.norm` (split layer norm, synchronised batch norm),
:mod:`.dropout` and :mod:`.attention` (attention with dropout, ring attention, the
split-sequence convolution). :mod:`autoshard.runtime.parallel_ops` binds the kernel
objects of :mod:`autoshard.ir.kernels` to them.
"""
