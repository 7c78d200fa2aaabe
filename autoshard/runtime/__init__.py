"""What runs on a rank: the counted collectives (:mod:`.collectives`), the parallel
kernels' autograd functions (:mod:`.parallel_ops`, which also binds each kernel
object of :mod:`autoshard.ir.kernels` to its implementation), process groups per
mesh axis (:mod:`.groups`), gradient-sync overlap, the first-call self-check and
the heartbeat. Imports the IR only.
"""
