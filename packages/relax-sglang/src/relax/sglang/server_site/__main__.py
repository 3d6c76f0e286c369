"""``python -m relax.sglang.server_site``: print the directory to put on an SGLang server's PYTHONPATH."""

from relax.sglang.server_site import SITE_DIR

print(SITE_DIR)
