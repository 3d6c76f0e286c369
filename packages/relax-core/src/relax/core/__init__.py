"""Relax core: hook specs, plugin manager, config, data model, transfer queue, controller and CPU backends."""

__version__ = "0.1.0"
