"""Conformance kit: pytest base classes a backend package subclasses in its own tests.

Work in progress; see the submodules.
"""
