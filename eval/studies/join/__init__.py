"""Issue #63's join study: how chat continuations are joined to the answer, per continuation mode."""
