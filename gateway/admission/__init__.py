"""Admission: who the tenant is, whether a request may run (rate limits, budgets, parallel slots),
and on which path: decoded token by token, or passed through whole to the upstream."""
