"""Run notifications through Apprise URLs (``logging.notify_urls``: Slack, Discord, e-mail, ntfy,
plain JSON webhooks ``json://host/path`` ...): start, failure, recovery, scale operations, completion.

Apprise is imported only when URLs are configured. A notification never breaks or stalls the run:
``send`` returns False (and logs why) on failure; ``send_later`` delivers from a thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

log = logging.getLogger("relax")

FAILURE_EVENTS = frozenset({"failed", "interrupted", "scale_failed"})
SUCCESS_EVENTS = frozenset({"completed", "recovered", "scaled"})


class Notifier:
    def __init__(self, urls: Sequence[str], run_name: str) -> None:
        try:
            import apprise
        except ImportError as exc:  # the optional extra is missing
            raise RuntimeError(
                "logging.notify_urls needs Apprise: pip install 'relax-core[control]'"
            ) from exc
        self._apprise = apprise
        self.client = apprise.Apprise()
        self.run_name = run_name
        bad = [url for url in urls if not self.client.add(url)]
        if bad:
            raise ValueError(
                f"logging.notify_urls: Apprise cannot use {bad} (unknown schema or malformed URL)"
            )
        self._threads: list[threading.Thread] = []

    def send(self, event: str, body: str) -> bool:
        """Deliver ``event`` to every URL now; True if all accepted it."""
        kind = self._apprise.NotifyType
        notify_type = (
            kind.FAILURE
            if event in FAILURE_EVENTS
            else kind.SUCCESS
            if event in SUCCESS_EVENTS
            else kind.INFO
        )
        try:
            ok = bool(
                self.client.notify(
                    title=f"relax {self.run_name}: {event}", body=body, notify_type=notify_type
                )
            )
        except Exception as exc:  # a notification must never break the run
            log.warning("relax: notification %r failed: %s", event, exc)
            return False
        if not ok:
            log.warning("relax: notification %r was not delivered to every URL", event)
        return ok

    def send_later(self, event: str, body: str) -> None:
        thread = threading.Thread(
            target=self.send, args=(event, body), name=f"relax-notify-{event}", daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait (bounded) for notifications sent with ``send_later``."""
        for thread in self._threads:
            thread.join(timeout_s)
        self._threads = [t for t in self._threads if t.is_alive()]
