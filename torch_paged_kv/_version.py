"""The package version, in one place: pyproject.toml and checkpoints read it."""

__version__ = "0.1.0"
