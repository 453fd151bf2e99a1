"""Drift against a reference server: the run's reference configuration, the per-partition sums
the scorer (``workers/reference.py``) keeps, and the figures status and the dashboard read.

A run may name a reference server (``enqueue --quality-reference URL``, or the setting
``quality_reference_url``). A sampled share of its committed jobs (``quality_sample``, at
least ``quality_sample_min`` a partition) is scored there by teacher forcing: a job's score
difference is the reference's mean per-token log-probability of its *own* output for the
job's prompt and sampling options, less that of the output the run produced. ``drift`` is the
mean of the differences over a partition's scored jobs, with a 95% confidence interval by the
normal approximation over jobs (``1.96 * s / sqrt(n)``): near 0 when the run's server behaves
like the reference, positive when the reference finds the run's outputs less likely than its
own.

Everything lives in the run's ``qref`` hash (:meth:`tokenmill.keys.RunKeys.quality_reference`):
the configuration (``url``, ``sample``, ``min``), the reference's latest failure (``error``,
``error_ms``; deleted once it answers again), and per partition ``<p>|sampled`` (jobs pushed to
the scorer's to-do list), ``<p>|skipped`` (sampled jobs that could not be scored: an empty
output, a request the reference refused), ``<p>|n``, ``<p>|sum``, ``<p>|sumsq`` (the scored
differences). :func:`rearm` drops the sums (``resume``: the ``drift`` rules count again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill import keys
from tokenmill.errors import ConfigError
from tokenmill.replies import text as text  # re-exported: workers/reference.py decodes with it
from tokenmill.url_secrets import redact_url

if TYPE_CHECKING:
    from tokenmill.quick_redis import ReadClient
    from tokenmill.settings import Settings

Z95 = 1.96
URL, SAMPLE, MIN, ERROR, ERROR_MS = "url", "sample", "min", "error", "error_ms"
SAMPLED, SKIPPED, N, SUM, SUMSQ = "sampled", "skipped", "n", "sum", "sumsq"
SUMS = (N, SUM, SUMSQ)


def field(partition: str, name: str) -> str:
    """The ``qref`` hash's field for ``name`` (one of :data:`SUMS`, ``sampled``, ``skipped``)."""
    return f"{partition}{keys.FIELD_SEP}{name}"


@dataclass(frozen=True, slots=True)
class Reference:
    """A run's reference: where it is, the share of jobs sampled, the least sampled a partition."""

    url: str
    sample: float
    minimum: int

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"--quality-reference {self.url!r} must be an http(s) URL")
        if not 0 <= self.sample <= 1:
            raise ConfigError(f"--quality-sample must be a fraction in [0, 1], got {self.sample}")
        if self.minimum < 0:
            raise ConfigError(f"quality_sample_min must not be negative, got {self.minimum}")

    def fields(self) -> dict[str, str]:
        """What enqueue writes into the run's ``qref`` hash."""
        return {URL: self.url, SAMPLE: repr(self.sample), MIN: str(self.minimum)}

    @classmethod
    def of(cls, raw: dict[str, str]) -> Reference | None:
        """The reference a ``qref`` hash (decoded) names, None without one."""
        if not raw.get(URL):
            return None
        return cls(raw[URL], float(raw.get(SAMPLE) or 0), int(raw.get(MIN) or 0))


@dataclass(frozen=True, slots=True)
class Drift:
    """A partition's scored differences: count, sum, sum of squares."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    @property
    def ci95(self) -> float | None:
        """Half-width of the 95% interval of the mean (None below two jobs)."""
        if self.n < 2:
            return None
        var = max(0.0, (self.squares - self.total * self.total / self.n) / (self.n - 1))
        return Z95 * math.sqrt(var / self.n)


def decode(raw: dict[Any, Any]) -> dict[str, str]:
    return {text(k): text(v) for k, v in raw.items()}


def per_partition(raw: dict[str, str]) -> dict[str, dict[str, str]]:
    """The ``qref`` hash's per-partition fields, by partition then name."""
    out: dict[str, dict[str, str]] = {}
    for f, v in raw.items():
        partition, sep, name = f.rpartition(keys.FIELD_SEP)
        if sep:
            out.setdefault(partition, {})[name] = v
    return out


def drift_view(client: ReadClient, run: str) -> dict[str, dict[str, Any]]:
    """Per partition with a sampled job: ``{"drift", "ci95", "n", "sampled", "skipped",
    "reference", "error"}`` (``drift``/``ci95`` None until scored; ``error``: the reference's
    latest failure while it lasts). Empty when the run names no reference."""
    raw = decode(client.hgetall(keys.RunKeys(run).quality_reference()))
    ref = Reference.of(raw)
    if ref is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for partition, f in sorted(per_partition(raw).items()):
        d = Drift(int(f.get(N) or 0), float(f.get(SUM) or 0), float(f.get(SUMSQ) or 0))
        out[partition] = {
            "drift": None if d.mean is None else round(d.mean, 4),
            "ci95": None if d.ci95 is None else round(d.ci95, 4),
            "n": d.n,
            "sampled": int(f.get(SAMPLED) or 0),
            "skipped": int(f.get(SKIPPED) or 0),
            "reference": redact_url(ref.url),
            "error": raw.get(ERROR),
        }
    return out


def chosen(settings: Settings, url: str | None, sample: float | None) -> Reference | None:
    """The run's reference: ``enqueue``'s ``--quality-reference`` and ``--quality-sample``, else
    the settings'; None without a URL (a ``--quality-sample`` alone is a mistake)."""
    url = url or settings.quality_reference_url
    if not url:
        if sample is not None:
            raise ConfigError("--quality-sample needs a reference: --quality-reference URL")
        return None
    sample = settings.quality_sample if sample is None else sample
    return Reference(url.rstrip("/"), sample, settings.quality_sample_min)


def store(client: Any, run: str, reference: Reference | None) -> None:
    """Write the run's reference into its ``qref`` hash (an enqueue without one leaves it)."""
    if reference is not None:
        client.hset(keys.RunKeys(run).quality_reference(), mapping=reference.fields())


def rearm(client: Any, run: str) -> None:
    """Drop every partition's sums (``resume``: ``drift`` rules judge only what is scored after)."""
    k = keys.RunKeys(run).quality_reference()
    names = [f for f in map(text, client.hkeys(k)) if f.rpartition(keys.FIELD_SEP)[2] in SUMS]
    if names:
        client.hdel(k, *names)
