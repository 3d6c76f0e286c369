"""Errors the ``relax`` command reports as one line (exit 2), importable without torch."""


class ConfigError(ValueError):
    """Invalid configuration; the message lists every problem found."""
