"""Structured output: generation constrained to a JSON schema, a regular expression or a grammar (llguidance)."""
