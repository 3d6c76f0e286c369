"""Relax reward hub: verifiable rewards registered through the ``relax`` entry-point group."""
