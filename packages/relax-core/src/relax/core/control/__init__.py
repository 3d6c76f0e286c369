"""Control plane: a REST API on Ray Serve started by ``relax run`` when ``control.enabled``, its CLI
client, an autoscaler policy, Apprise notifications and Prometheus exposition.

Ray Serve, FastAPI and Apprise come with the optional extra ``relax-core[control]`` and are imported
only by the modules that need them (``app``, ``server``, ``notify``), so ``relax.core`` imports
without them.
"""
