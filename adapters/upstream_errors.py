"""How an upstream fails: its exceptions, which failures are transient, what a failure holds
against the upstream, and the circuit breaker that keeps a failing upstream from being called."""

from __future__ import annotations

import re
from typing import Literal

import httpx


class UpstreamUnavailable(Exception):
    """The upstream failed, timed out, or its circuit breaker is open."""

    reason = "upstream_unavailable"
    final = False  # True: the same request's next call would fare no better, so it asks nothing more


class UpstreamRejected(UpstreamUnavailable):
    """The upstream refused this request itself (a 4xx such as context length or a content filter):
    not retried, not held against the upstream, and the same request would be refused again."""

    reason = "upstream_rejected"
    final = True


class UpstreamFailedRequest(UpstreamUnavailable):
    """The upstream answered a 5xx to a call that carried values the client chose (see
    `failure_of`), retries included: possibly this request's own fault, so it is not held against
    the upstream and the request asks it nothing more; the client is told the upstream failed
    (`upstream_unavailable`, a 502 to a passed-through request)."""

    final = True


class UpstreamBusy(UpstreamUnavailable):
    """No slot of the upstream came free in time: it is busy, not failing (the breaker is untouched),
    and a request that met this asks it nothing more."""

    reason = "upstream_busy"
    final = True


def status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    if status is None and isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
    return status if isinstance(status, int) else None


def is_transient(exc: BaseException) -> bool:
    """Transport errors, time-outs, 408, 429 and 5xx: worth a retry and held against the breaker."""
    status = status_of(exc)
    return status is None or status in (408, 429) or status >= 500


Failure = Literal["outage", "refused", "request"]


def failure_of(exc: BaseException, client_values: bool) -> Failure:
    """What one failed call says about the upstream, which all tenants share.

    `refused`: a 4xx other than 408 and 429, the request's own fault (the upstream is up).
    `request`: a 5xx to a call that carried values the client chose (a seed, penalties, a whole
    passed-through body): possibly the request's own fault (llama-server answered 500 to a seed of
    10**309), so it holds nothing against the upstream. `outage`: the rest (transport errors,
    time-outs, 408, 429, a 5xx to a call that carried none), held against it. `temperature` and
    `top_p` do not make a call the client's: every hand-off sends them, in ranges every upstream
    takes, and an upstream that fails every call must still open its breaker through those calls."""
    if not is_transient(exc):
        return "refused"
    status = status_of(exc)
    return "request" if client_values and status is not None and status >= 500 else "outage"


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

    def record_failure(self, failure: Failure, now: float, trial: bool = False) -> None:
        """Record a failed call as `failure_of` judged it: an outage counts, a refusal shows the
        upstream up, and a failure possibly of the request's own making counts neither way."""
        if failure == "request":
            self.abandon(trial)
        else:
            self.record(failure == "refused", now, trial)


# litellm's prefixes on an upstream's words: "litellm.BadRequestError: OpenAIException - ..."
LITELLM_PREFIX = re.compile(r"^(?:litellm\.\w+:\s*)?(?:\w+Exception\s*-\s*)?")
WORDS_CHARS = 300  # the most of an upstream's own words a client is shown


def upstream_message(exc: BaseException) -> str:
    """The upstream's own words from an error (its OpenAI-shaped body when there is one), without
    litellm's class names and cut to WORDS_CHARS: a client sees what the upstream said, never
    the gateway's internals."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return _cut(str(error["message"]))
    return _cut(LITELLM_PREFIX.sub("", str(getattr(exc, "message", None) or exc), count=1))


def _cut(words: str) -> str:
    return words if len(words) <= WORDS_CHARS else f"{words[:WORDS_CHARS]}..."
