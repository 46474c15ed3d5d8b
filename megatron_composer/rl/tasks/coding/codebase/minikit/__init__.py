"""minikit: small text, number and data-structure helpers."""
