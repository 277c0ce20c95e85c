"""Integrations with model libraries. Import the submodule you need (`integrations.transformers`)."""
