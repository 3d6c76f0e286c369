"""HTTP calls to one SGLang server: blocking control calls (``requests``) and async ``/generate``
(``aiohttp``, one session and one concurrency bound per event loop -- Ray actors run each ``generate``
on a fresh loop, and an aiohttp session must not outlive or cross its loop). Every call has a timeout;
failures name the server and the endpoint."""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

import requests


class SGLangHTTPError(RuntimeError):
    """An SGLang endpoint failed or did not answer in time."""


class SGLangClient:
    def __init__(
        self, url: str, name: str, control_timeout_s: float, request_timeout_s: float, max_concurrency: int
    ):
        self.url, self.name = url.rstrip("/"), name
        self.control_timeout_s, self.request_timeout_s = control_timeout_s, request_timeout_s
        self.max_concurrency = max_concurrency
        self._http = requests.Session()
        self._lock = threading.Lock()
        self._per_loop: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[Any, asyncio.Semaphore]
        ] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ control (blocking)
    def post(self, endpoint: str, body: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        return self._call("POST", endpoint, body, timeout_s)

    def get(self, endpoint: str, timeout_s: float | None = None) -> Any:
        return self._call("GET", endpoint, None, timeout_s)

    def _call(self, method: str, endpoint: str, body: dict[str, Any] | None, timeout_s: float | None) -> Any:
        timeout = timeout_s or self.control_timeout_s
        try:
            resp = self._http.request(method, self.url + endpoint, json=body, timeout=timeout)
        except requests.Timeout as exc:
            raise SGLangHTTPError(f"{self.name}: {endpoint} did not answer within {timeout:g}s") from exc
        except requests.ConnectionError as exc:
            raise SGLangHTTPError(f"{self.name}: {endpoint} unreachable (server down?): {exc}") from exc
        if resp.status_code != 200:
            raise SGLangHTTPError(
                f"{self.name}: {endpoint} returned HTTP {resp.status_code}: {resp.text[:500]}"
            )
        if not resp.content:
            return None
        try:
            out = resp.json()
        except ValueError:  # a plain-text answer (sglang-router's /health: "OK")
            return resp.text
        if isinstance(out, dict) and out.get("success") is False:
            raise SGLangHTTPError(f"{self.name}: {endpoint} failed: {out.get('message')}")
        return out

    # ------------------------------------------------------------------ generation (async)
    def _session(self) -> tuple[Any, asyncio.Semaphore]:
        import aiohttp

        loop = asyncio.get_running_loop()
        with self._lock:
            held = self._per_loop.get(loop)
            if held is None or held[0].closed:
                connector = aiohttp.TCPConnector(limit=self.max_concurrency)
                held = (aiohttp.ClientSession(connector=connector), asyncio.Semaphore(self.max_concurrency))
                self._per_loop[loop] = held
                loop_close = loop.close

                def close_session_first(session=held[0]) -> None:  # asyncio.run closes the loop last
                    if not session.closed and not loop.is_running():
                        loop.run_until_complete(session.close())
                    loop_close()

                loop.close = close_session_first  # type: ignore[method-assign]
            return held

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        import aiohttp

        session, slots = self._session()
        async with slots:
            try:
                timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
                async with session.post(self.url + "/generate", json=payload, timeout=timeout) as resp:
                    if resp.status != 200:
                        raise SGLangHTTPError(
                            f"{self.name}: /generate returned HTTP {resp.status}: {(await resp.text())[:500]}"
                        )
                    return await resp.json()
            except TimeoutError as exc:
                raise SGLangHTTPError(
                    f"{self.name}: /generate did not finish within {self.request_timeout_s:g}s"
                ) from exc
            except aiohttp.ClientError as exc:
                raise SGLangHTTPError(f"{self.name}: /generate failed (server down?): {exc!r}") from exc

    def close(self) -> None:
        self._http.close()
