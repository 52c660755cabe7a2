"""Routing-history features: an offline ablation (docs/studies/history.md)."""
