"""Getting every rank to the same rewritten graph quickly: one rank captures and the
others load it (:mod:`.capture_share`), each rank keeps what its last launch ended in
(:mod:`.launch_cache`), and a new input signature is captured again
(:mod:`.recapture`).
"""
