"""Relax's text-LM model families: one model adapter per family (``relax.core.model_family``)."""
