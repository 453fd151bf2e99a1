"""The server manager's ``/health`` probe (``/metrics`` and ``/v1/loads`` are read by
``tokenmill.server_report``, which workers share).

Readiness is ``/health`` answering 200, never ``/v1/models`` (it answers before warmup). A healthy
``/health`` takes about a second (it runs a one-token generation); a wedged one hangs for up to
20 s and then answers 503, so every probe has a timeout and the caller counts a failure streak.
"""

from __future__ import annotations

import urllib.error
import urllib.request


def probe_health(base_url: str, timeout_s: float) -> str | None:
    """GET ``/health``: None on 200, else what went wrong (a refused connection, a 503, a timeout)."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=timeout_s) as resp:
            status = resp.status
            error = ""
    except urllib.error.HTTPError as exc:
        status, error = exc.code, f"/health answered {exc.code}"
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        status, error = None, f"/health: {reason}"
        if isinstance(reason, TimeoutError) or "timed out" in str(reason):
            error = f"/health did not answer within {timeout_s:g} s"
    return None if status == 200 else error
