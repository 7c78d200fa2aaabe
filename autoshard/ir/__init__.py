"""The intermediate representation: what a plan *is*, as data.

The mesh (:mod:`.mesh`), the layout of a tensor (:mod:`.spec`), the plan
(:mod:`.plan`), the kernel objects a policy picks (:mod:`.kernels`), and the
small vocabulary they share (argument paths, errors, log, the grouped-matmul op,
input signatures, the SVG drawing of a plan). Nothing here imports another layer
of autoshard, and nothing here runs a collective: ``autoshard.plan()`` for 4096
ranks needs only this layer, the policies and the passes.
"""
