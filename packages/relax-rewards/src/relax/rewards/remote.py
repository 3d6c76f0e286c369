"""``remote``: a reward model behind HTTP -- one JSON POST per group of samples.

Request body: ``{batch_key: [{field: value, ...} per sample]}`` where ``fields`` maps each JSON
field to a sample attribute (``prompt_text``, ``response_text``, ``label``, ``group_id``,
``index_in_group``) or ``metadata.<key>``. Response: ``{scores_key: [score, ...]}`` with one float
(or ``{"score": ..., ...}``) per sample. 5xx, 429, connection errors and timeouts are retried with
exponential backoff; other 4xx and malformed replies fail at once with a message naming the URL.
A token for the auth header is read from the environment variable ``auth_env`` at call time, so
it never sits in the config file or the run's logged config.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

_ATTRS = ("prompt_text", "response_text", "label", "group_id", "index_in_group")


@dataclass(frozen=True)
class RemoteParams:
    """``reward.params`` of ``remote``."""

    url: str = ""
    fields: dict[str, str] = field(
        default_factory=lambda: {"prompt": "prompt_text", "response": "response_text", "label": "label"}
    )
    batch_key: str = "samples"
    scores_key: str = "scores"
    timeout_s: float = 10.0  # per HTTP attempt
    retries: int = 3  # attempts after the first
    backoff_s: float = 0.5  # wait before the first retry, doubled each time
    auth_env: str | None = None  # environment variable holding the token
    auth_header: str = "Authorization"
    auth_scheme: str = "Bearer"  # header value: "<scheme> <token>" ("" for the bare token)

    def validate(self) -> list[str]:
        errors = []
        if not self.url.startswith(("http://", "https://")):
            errors.append(f"url: must be an http:// or https:// URL, got {self.url!r}")
        if not self.timeout_s > 0:
            errors.append(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.retries < 0 or self.backoff_s < 0:
            errors.append(f"retries, backoff_s: must be >= 0, got {self.retries}, {self.backoff_s}")
        for key, attr in self.fields.items():
            if attr not in _ATTRS and not str(attr).startswith("metadata."):
                errors.append(f"fields.{key}: {attr!r} is not one of {', '.join(_ATTRS)} or metadata.<key>")
        return errors


class RemoteRewardError(RuntimeError):
    pass


def request_item(sample: Any, fields: dict[str, str]) -> dict[str, Any]:
    item = {}
    for key, attr in fields.items():
        item[key] = (
            (sample.metadata or {}).get(attr[9:]) if attr.startswith("metadata.") else getattr(sample, attr)
        )
    return item


class RemoteReward:
    """Inline in the hub (network-bound, holds a connection pool)."""

    isolation = "inline"

    def __init__(self, params: RemoteParams, ctx: Any = None) -> None:
        errors = params.validate()
        if errors:
            raise ValueError("remote reward: " + "; ".join(errors))
        self.params = params
        self._session = None

    def _headers(self) -> dict[str, str]:
        p = self.params
        if not p.auth_env:
            return {}
        token = os.environ.get(p.auth_env)
        if not token:
            raise RemoteRewardError(
                f"remote reward: environment variable {p.auth_env!r} (auth_env) is not set"
            )
        return {p.auth_header: f"{p.auth_scheme} {token}".strip()}

    def post(self, samples: list[Any]) -> list[Any]:
        """Blocking: one POST (with retries) for ``samples``; their scores in order."""
        import requests

        p = self.params
        if self._session is None:
            self._session = requests.Session()
        body = {p.batch_key: [request_item(s, p.fields) for s in samples]}
        headers = self._headers()
        last = ""
        for attempt in range(p.retries + 1):
            if attempt:
                time.sleep(p.backoff_s * 2 ** (attempt - 1))
            try:
                resp = self._session.post(p.url, json=body, headers=headers, timeout=p.timeout_s)
            except (requests.ConnectionError, requests.Timeout) as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if resp.status_code >= 500 or resp.status_code == 429:
                last = f"HTTP {resp.status_code}"
                continue
            if resp.status_code >= 400:
                raise RemoteRewardError(f"remote reward {p.url}: HTTP {resp.status_code}: {resp.text[:200]}")
            return self._scores(resp, len(samples))
        raise RemoteRewardError(
            f"remote reward {p.url}: gave up after {p.retries + 1} attempts (last: {last})"
        )

    def _scores(self, resp: Any, n: int) -> list[Any]:
        p = self.params
        try:
            data = resp.json()
        except ValueError:
            raise RemoteRewardError(
                f"remote reward {p.url}: reply is not JSON: {resp.text[:200]!r}"
            ) from None
        scores = data.get(p.scores_key) if isinstance(data, dict) else None
        if not isinstance(scores, list) or len(scores) != n:
            raise RemoteRewardError(
                f"remote reward {p.url}: expected {{{p.scores_key!r}: [{n} scores]}}, got {str(data)[:200]}"
            )
        return scores

    async def score_group(self, samples: list[Any]) -> list[Any]:
        from relax.core.rewards.bounded import in_daemon_thread

        return await in_daemon_thread(self.post, list(samples))

    async def score(self, sample: Any) -> Any:
        return (await self.score_group([sample]))[0]

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
