"""Choosing and checking a layout before any process runs: validation of the
configuration (:mod:`.validate`), the cost model (:mod:`.cost`), the search over
layouts (:mod:`.search`), the activation-memory trace (:mod:`.activations`), plan
differences (:mod:`.plan_diff`) and shrunk configs that split as the real ones do
(:mod:`.shrink`).
"""
