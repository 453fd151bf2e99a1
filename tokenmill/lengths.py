"""A run's completion lengths as a survival curve: what admission projects a request's KV from.

Lengths are counted in bins (16 tokens wide below 128, then 8 bins per doubling, so a bin is at
most 1/8 of its lower edge). While a request runs it reports each bin it *reaches*; when it ends
it reports the bin it *ended* in. The chance of ending in bin b, given the bin was reached, is
``ended_b / reached_b``: a discrete Kaplan-Meier estimate in which running requests count as
survivors, so the short outputs that finish first do not bias it low; a bin fewer than
``MIN_AT_RISK`` requests are known to have reached says too little, so the curve stops before
it. Beyond the last bin enough requests reached nothing is known: the mass left there is put at
``max_tokens`` (the safe prior), so before enough have finished a request is expected to reach
``max_tokens``.

The hold projected for a request of prompt p that has generated g tokens is the peak over x >= g
of its expected KV at length x, ``(p + x) * P(L >= x | L >= g)``: it grows to p + g as the
request grows, and counts that a request which ends frees its KV (so requests started together
do not all peak at max_tokens). x is rounded up to its bin's upper edge (at most 1/8 more).

The prompt p is tokenmill's estimate (:mod:`tokenmill.tokens`) plus the run's *prompt offset*:
the hash also counts, for requests that ended on their first attempt, their estimated prompt
tokens (``pe``) and the prompt tokens they held in the server's KV pool (``pk``: the server's
count, less the tokens it reported served from its prefix cache), so once ``MIN_PROMPT_SAMPLE``
requests have reported, the projection adds their mean difference: prompts are held at the
server's size (its tokenizer, and its chat template's tokens, tools' schemas included, which the
estimate does not see), not at a bytes-per-token guess. An offset, not a ratio: what the
estimate misses is mostly a request's fixed part (a template, a tool's schema), and a ratio
taken on a run whose few requests carry tools would multiply every prompt of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

FINE_UNTIL = 128  # bins of FINE_WIDTH below this
FINE_WIDTH = 16
PER_DOUBLING = 8
_REACHED, _ENDED = "r", "e"  # lengths-hash field prefixes: r<bin>, e<bin>
PROMPTS, PROMPT_ESTIMATED, PROMPT_KV = "pn", "pe", "pk"  # the prompt offset's sample (see above)
MIN_PROMPT_SAMPLE = 4  # requests reported before the offset replaces 0
# The curve stops at the first bin fewer requests were seen to reach: beyond it the mass is the
# unknown tail. Running requests report their bins at heartbeats, so the first outputs to end
# may be all that reached a bin yet: one request that ended at 147 tokens, its 16 siblings
# running unreported, would say every output ends by 160. (8 held the sim's mixed outputs at
# the prior longer: 5.3 s against 5.0-5.1 at 1 and 4.)
MIN_AT_RISK = 4
_FINE_BINS = FINE_UNTIL // FINE_WIDTH
_FIRST_OCTAVE = FINE_UNTIL.bit_length() - 1


def bin_of(tokens: int) -> int:
    """The bin a length of ``tokens`` falls in."""
    if tokens < FINE_UNTIL:
        return max(0, tokens) // FINE_WIDTH
    octave = tokens.bit_length() - 1
    step = 1 << (octave - 3)
    return _FINE_BINS + (octave - _FIRST_OCTAVE) * PER_DOUBLING + (tokens - (1 << octave)) // step


def edge(b: int) -> int:
    """The lower edge (in tokens) of bin ``b``."""
    if b < _FINE_BINS:
        return b * FINE_WIDTH
    octave = _FIRST_OCTAVE + (b - _FINE_BINS) // PER_DOUBLING
    return (1 << octave) + ((b - _FINE_BINS) % PER_DOUBLING) * (1 << (octave - 3))


def reached(after: int, upto: int) -> list[int]:
    """Bins first reached when a request goes from ``after`` tokens (-1: not started) to ``upto``."""
    if upto <= after:
        return []
    return list(range(bin_of(after) + 1 if after >= 0 else 0, bin_of(upto) + 1))


@dataclass(frozen=True, slots=True)
class Survival:
    """``s[b]`` = P(L >= edge(b)) for the bins with data; ``s[-1]`` is the unknown tail's mass."""

    s: tuple[float, ...] = (1.0,)
    ended: int = 0  # requests that ended (the sample behind the curve)
    running: int = 0  # requests seen running and not ended (censored)
    prompt_offset: float = 0.0  # the server's KV prompt tokens less the estimate, a request's mean

    @classmethod
    def from_counts(
        cls, reached_n: Mapping[int, int], ended_n: Mapping[int, int], prompt_offset: float = 0.0
    ) -> Survival:
        """The curve from per-bin counts of requests that reached and that ended in each bin."""
        s = [1.0]
        b = 0
        while reached_n.get(b, 0) >= MIN_AT_RISK:
            n, d = reached_n[b], ended_n.get(b, 0)
            s.append(s[-1] * max(0.0, 1.0 - d / max(n, d)))
            b += 1
        ended = sum(ended_n.values())
        return cls(tuple(s), ended, max(0, reached_n.get(0, 0) - ended), prompt_offset)

    def prompt(self, estimate: int) -> int:
        """A prompt's projected KV tokens from tokenmill's estimate of it."""
        return estimate if not self.prompt_offset else max(1, int(estimate + self.prompt_offset + 0.999))

    @property
    def tail(self) -> float:
        """Probability mass beyond every observed length (assumed to reach max_tokens)."""
        return self.s[-1]

    def survives(self, x: int) -> float:
        """P(L >= x), linear within a bin; the tail's mass beyond the data."""
        b = bin_of(x)
        if b >= len(self.s) - 1:
            return self.tail
        lo, hi = edge(b), edge(b + 1)
        return self.s[b] + (self.s[b + 1] - self.s[b]) * (x - lo) / (hi - lo)

    def hold(self, prompt: int, max_tokens: int, generated: int = 0) -> int:
        """Projected peak KV of a request: max over x >= g of (prompt + x) P(L >= x | L >= g),
        each x rounded up to its bin's upper edge (or max_tokens)."""
        g = generated
        if g >= max_tokens:
            return prompt + g
        given = self.survives(g)
        if given <= 0:  # longer than anything seen: only the prior is left
            return prompt + max_tokens
        known = len(self.s) - 1
        best = float(prompt + g)
        for b in range(min(bin_of(g), known), min(bin_of(max_tokens), known) + 1):
            x = min(edge(b + 1), max_tokens) if b < known else max_tokens
            best = max(best, (prompt + x) * min(1.0, self.s[b] / given))
        return int(best + 0.999)

    def quantile(self, q: float) -> int | None:
        """The length below which a fraction ``q`` of requests ends (None: in the unknown tail)."""
        for b, p in enumerate(self.s):
            if 1.0 - p >= q:
                return edge(b)
        return None

    def mean_known(self) -> float | None:
        """Mean length of the observed part of the curve (None when nothing ended)."""
        if not self.ended or self.tail >= 1.0:
            return None
        mass = sum((self.s[b] - self.s[b + 1]) * (edge(b) + edge(b + 1)) / 2 for b in range(len(self.s) - 1))
        return mass / (1.0 - self.tail)


def parse_counts(
    raw: Mapping[bytes | str, bytes | str | int],
) -> tuple[dict[int, int], dict[int, int], float]:
    """(reached, ended) per bin from the run's lengths hash (fields ``r<bin>`` and ``e<bin>``), and
    the prompt offset (0 until ``MIN_PROMPT_SAMPLE`` requests reported their prompts)."""
    reached_n: dict[int, int] = {}
    ended_n: dict[int, int] = {}
    prompts: dict[str, int] = {}
    for f, v in raw.items():
        name = f.decode() if isinstance(f, bytes) else f
        target = reached_n if name[0] == _REACHED else ended_n if name[0] == _ENDED else None
        if target is not None and name[1:].isdigit():
            target[int(name[1:])] = int(v)
        elif name in (PROMPTS, PROMPT_ESTIMATED, PROMPT_KV):
            prompts[name] = int(v)
    offset = 0.0
    if prompts.get(PROMPTS, 0) >= MIN_PROMPT_SAMPLE:
        offset = (prompts.get(PROMPT_KV, 0) - prompts.get(PROMPT_ESTIMATED, 0)) / prompts[PROMPTS]
    return reached_n, ended_n, offset


def prompt_fields(estimated: int, kv: int) -> list[tuple[str, int]]:
    """The lengths-hash fields one request's prompt raises, and by how much (the offset's sample)."""
    return [(PROMPTS, 1), (PROMPT_ESTIMATED, estimated), (PROMPT_KV, kv)]


def reached_field(b: int) -> str:
    """The lengths-hash field counting requests that reached bin ``b``."""
    return f"{_REACHED}{b}"


def ended_field(b: int) -> str:
    """The lengths-hash field counting requests that ended in bin ``b``."""
    return f"{_ENDED}{b}"
