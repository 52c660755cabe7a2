"""One router for mixed traffic, and whether its probability is one where it serves (docs/studies/mixed.md)."""
