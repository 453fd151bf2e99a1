"""tokenmill: prompts in, completions out, exactly once, on Celery and Redis.

The Python API (docs/python-api.md)::

    import tokenmill

    tm = tokenmill.Client()                     # TOKENMILL_* settings, or Client(redis_url=...)
    r = tm.enqueue(rows, run="r")               # r.new, r.existing
    st = tm.wait("r")                           # the final status; st.totals["done"]
    for row in tm.results("r"): ...             # the rows `tokenmill export` writes

The names in ``__all__`` are the public API; everything else in the package is internal. They
are loaded on first use, so ``import tokenmill`` (which every tokenmill process does, the CLI
and the workers included) costs nothing more.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it, for the names not in tokenmill.errors (the API itself
# lives with the producer: only this map, like the CLI root's, names a component from the shared
# package)
_PUBLIC = {
    "Client": "producer.client",
    "Status": "producer.documents",
    "RunInfo": "producer.documents",
    "EnqueueResult": "producer.documents",
    "RetrySummary": "producer.retry",
    "CancelSummary": "producer.cancel",
}

__all__ = [
    "CancelSummary",
    "Client",
    "ConfigError",
    "EnqueueResult",
    "ExportError",
    "IdConflictError",
    "InputError",
    "MissingExtraError",
    "RedisUnavailableError",
    "ResultStoreError",
    "RetrySummary",
    "RunInfo",
    "ShardLostError",
    "Status",
    "TokenmillError",
    "WaitTimeoutError",
    "__version__",
]

if TYPE_CHECKING:
    from producer.cancel import CancelSummary
    from producer.client import Client
    from producer.documents import EnqueueResult, RunInfo, Status
    from producer.retry import RetrySummary
    from tokenmill.errors import (
        ConfigError,
        ExportError,
        IdConflictError,
        InputError,
        MissingExtraError,
        RedisUnavailableError,
        ResultStoreError,
        ShardLostError,
        TokenmillError,
        WaitTimeoutError,
    )


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC.get(name, "tokenmill.errors")), name)
    globals()[name] = value  # found once; later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
