"""Logging set-up for the entry points (libraries never configure logging)."""

from __future__ import annotations

import json
import logging
import sys

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record (time, level, logger, message, exception), for log pipelines.

    >>> rec = logging.LogRecord("draftcache", logging.INFO, "", 0, "rebuilt %s", ("ns",), None)
    >>> json.loads(JsonFormatter().format(rec))["message"]
    'rebuilt ns'
    """

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure(fmt: str = "text", verbose: bool = False) -> None:
    """Log to stderr as text or JSON lines; apscheduler's per-run lines are noise."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler], force=True)
    logging.getLogger("apscheduler").setLevel(logging.ERROR)
