"""Start and stop the control plane of one run: the hub actor, the Serve app, the driver agent.

Serve binds ``control.host:control.port`` (127.0.0.1 by default). Bound anywhere else the API
requires a bearer token: ``control.token``, else ``$RELAX_CONTROL_TOKEN``, else one generated here
and printed once. If Serve already runs on this Ray cluster (another app, a test session), the
control app is added to it and only the app is deleted at the end; otherwise Serve is shut down too.
"""

from __future__ import annotations

import logging
import os
import secrets
import uuid
from typing import Any

import ray

from relax.core.control.agent import ControlAgent
from relax.core.control.settings import is_loopback
from relax.core.control.state import ControlState

log = logging.getLogger("relax")

APP_NAME = "relax-control"
TOKEN_ENV = "RELAX_CONTROL_TOKEN"


def resolve_token(host: str, configured: str | None) -> tuple[str | None, bool]:
    """(token, generated): the configured or environment token; a new one when bound off loopback."""
    token = configured or os.environ.get(TOKEN_ENV) or None
    if token is None and not is_loopback(host):
        return secrets.token_urlsafe(32), True
    return token, False


def serve_address() -> tuple[str, int] | None:
    """(host, port) of the Serve instance running on this Ray cluster, or None."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return None if client is None else (client.http_config.host, client.http_config.port)


def start_hub(name: str) -> Any:
    from relax.core.control.app import NAMESPACE

    return ray.remote(num_cpus=0)(ControlState).options(name=name, namespace=NAMESPACE).remote()


def deploy(
    hub_name: str, token: str | None, host: str, port: int, app_name: str = APP_NAME, route_prefix: str = "/"
) -> tuple[bool, str]:
    """Run the control app on Serve, starting Serve on ``host:port`` unless it runs already (then
    its address is used, with a warning if it differs); returns (started here, base URL)."""
    from ray import serve

    from relax.core.control.app import ControlAPI

    running = serve_address()
    if running is None:
        serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    elif running != (host, port):
        log.warning(
            "relax: Serve already runs on %s:%d; the control API is served there, not on %s:%d",
            *running,
            host,
            port,
        )
        host, port = running
    serve.run(ControlAPI.bind(hub_name, token), name=app_name, route_prefix=route_prefix, blocking=False)
    return running is None, f"http://{host}:{port}{route_prefix.rstrip('/')}"


class ControlPlane:
    def __init__(self, run: Any, notify: Any = None) -> None:
        self.run, self.cfg = run, run.config.control
        self.hub_name = f"relax-control-hub-{uuid.uuid4().hex[:8]}"
        self.token, generated = resolve_token(self.cfg.host, self.cfg.token)
        self.hub = start_hub(self.hub_name)
        try:
            self.started_serve, self.address = deploy(self.hub_name, self.token, self.cfg.host, self.cfg.port)
            self.agent = ControlAgent(run, self.hub, notify).start()
        except BaseException:
            ray.kill(self.hub)
            raise
        print(f"relax: control plane at {self.address} (OpenAPI: {self.address}/docs)", flush=True)
        if generated:
            print(
                f"relax: control token (shown once; clients send it as Authorization: Bearer): {self.token}",
                flush=True,
            )

    def stop(self, status: str) -> None:
        from ray import serve

        self.agent.close(status)
        try:
            if self.started_serve:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.kill(self.hub)
