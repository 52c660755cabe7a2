"""How an upstream fails: its exceptions, which failures are transient, and the circuit breaker
that keeps a failing upstream from being called."""

from __future__ import annotations

import httpx


class UpstreamUnavailable(Exception):
    """The upstream failed, timed out, or its circuit breaker is open."""

    reason = "upstream_unavailable"


class UpstreamRejected(UpstreamUnavailable):
    """The upstream refused this request itself (a 4xx such as context length or a content filter):
    not retried, not held against the upstream, and the same request would be refused again."""

    reason = "upstream_rejected"


class UpstreamBusy(UpstreamUnavailable):
    """No slot of the upstream came free in time: it is busy, not failing (the breaker is untouched),
    and a request that met this asks it nothing more."""

    reason = "upstream_busy"


def status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    if status is None and isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
    return status if isinstance(status, int) else None


def is_transient(exc: BaseException) -> bool:
    """Transport errors, time-outs, 408, 429 and 5xx: worth a retry and held against the breaker."""
    status = status_of(exc)
    return status is None or status in (408, 429) or status >= 500


class CircuitBreaker:
    """Closed, calls pass; `failures` transient failures in a row open it for `cooldown_s`; then it is
    half-open: one trial call passes (others are refused meanwhile) and its outcome closes or re-opens it."""

    def __init__(self, failures: int, cooldown_s: float) -> None:
        self._limit, self._cooldown = failures, cooldown_s
        self._consecutive = 0
        self._opened_at: float | None = None
        self._trial_running = False

    def allows(self, now: float) -> bool:
        """Would a call pass now? (No side effect.)"""
        if self._opened_at is None:
            return True
        return not self._trial_running and now - self._opened_at >= self._cooldown

    def acquire(self, now: float) -> bool | None:
        """Let one call through: None if refused, True if it is the half-open trial, else False."""
        if not self.allows(now):
            return None
        if self._opened_at is None:
            return False
        self._trial_running = True
        return True

    def record(self, ok: bool, now: float, trial: bool = False) -> None:
        if trial:
            self._trial_running = False
        if ok:
            self._consecutive, self._opened_at = 0, None
            return
        self._consecutive += 1
        if self._consecutive >= self._limit or trial:
            self._opened_at = now

    def abandon(self, trial: bool) -> None:
        """A call ended without an outcome (cancelled): the next caller may try."""
        if trial:
            self._trial_running = False


def upstream_message(exc: BaseException) -> str:
    """The upstream's own words from an error (its OpenAI-shaped body when there is one)."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    return str(getattr(exc, "message", None) or exc)
