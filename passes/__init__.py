"""Graph passes: capture → annotate → propagate → rewrite (one module each)."""
