"""relax-omni plugin: registered through the `relax` entry-point group."""
