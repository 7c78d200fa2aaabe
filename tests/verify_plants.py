"""Planted planner bugs for tests/test_verify.py, called on every rank through
``verify(setup="verify_plants:NAME")`` (tests/ on PYTHONPATH)."""


def partial_through_nonlinear():
    """The generic rule lets a partial sum pass through any op (rsqrt, pow, ...), as if every
    op were linear in it: shapes stay right, values go wrong at the first nonlinear op."""
    from autoshard.policies import generic

    generic._partial_passes = lambda *args: True
