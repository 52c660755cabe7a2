"""Asking afresh: an answer-level check, and rating answers earlier (docs/studies/afresh.md)."""
