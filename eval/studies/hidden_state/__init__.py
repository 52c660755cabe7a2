"""Hidden-state routers and divergent labels (docs/studies/hidden_state.md)."""
