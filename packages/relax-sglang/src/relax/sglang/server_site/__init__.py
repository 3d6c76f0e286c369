"""Patches for SGLang servers, loaded by the server's own interpreter (not by Relax).

This directory goes first on a launched server's ``PYTHONPATH``, so its ``sitecustomize`` runs at the start
of the server and of every subprocess it spawns (scheduler, detokenizer) and installs
``relax_sglang_server_patches``; a server you launch yourself gets them the same way:
``PYTHONPATH=$(python -m relax.sglang.server_site) python -m sglang.launch_server ...``.
"""

from pathlib import Path

SITE_DIR = Path(__file__).resolve().parent
