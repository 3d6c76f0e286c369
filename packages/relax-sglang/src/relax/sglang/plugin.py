"""relax-sglang plugin: registered through the `relax` entry-point group."""
