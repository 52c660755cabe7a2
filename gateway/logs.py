"""Log lines: one JSON object (or text line) per event, each stamped with its request's id; a
last-resort filter masks anything that looks like a bearer key. Log lines carry ids, counts and
timings only: never keys or prompts."""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
from datetime import datetime, timezone
from typing import Any

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("gateway_request_id", default=None)

_SECRET = re.compile(r"(?i)\b(bearer\s+)[^\s\"',;]+|\bsk-[A-Za-z0-9_\-]{2,}")
_RECORD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "request_id", "color_message"}
_PLAIN = (str, int, float, bool, list, dict)  # other attributes are libraries' own bookkeeping


def redact(text: str) -> str:
    """Mask bearer tokens and `sk-` keys: a last line of defence, not a licence to log secrets."""
    return _SECRET.sub(lambda m: (m.group(1) or "sk-") + "[redacted]", text)


class RequestIdFilter(logging.Filter):
    """Stamps each record with the current request's id ("-" outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id, and the `extra=` fields that are set."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        request_id = getattr(record, "request_id", "-")
        if request_id != "-":
            body["request_id"] = request_id
        body.update({k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS and isinstance(v, _PLAIN)})
        if record.exc_info:
            body["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(body, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure_logging(level: str = "info", fmt: str = "json") -> None:
    """Root logging for the process: one handler on stderr, request ids on every line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per upstream call, URL and all
