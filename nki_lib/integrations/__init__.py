"""Integrations with other libraries (optional extras): ``nki_lib.integrations.transformers``."""
