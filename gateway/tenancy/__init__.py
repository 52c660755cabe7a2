"""Tenancy, below the runtime: who an API key is and what its tenant may use (tenants), what it may
spend upstream (budget: the app-wide ledger and each request's gate), and how its routing fields
resolve from alias, tenant and request (routing)."""
