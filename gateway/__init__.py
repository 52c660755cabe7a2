"""An OpenAI-compatible gateway: a small local model decodes, uncertain tokens go upstream."""
