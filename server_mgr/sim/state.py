"""The one mutable object of a running sim: status, faults, in-flight requests and counters.

Handlers reach it as ``request.app[STATE]``. Everything runs on one event loop, so no locks.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Literal

from aiohttp import web

from server_mgr.sim.config import SimConfig
from server_mgr.sim.decode import Degrade
from server_mgr.sim.logs import SimLog
from server_mgr.sim.scheduler import Scheduler, SimRequest

Status = Literal["Starting", "Up", "UnHealthy"]


@dataclass(slots=True)
class Faults:
    """Runtime faults toggled by ``POST /_sim/fault``."""

    health_stall: bool = False
    stall_streams: bool = False
    ignore_stop: bool = False
    degrade: Degrade | None = None  # answers degrade from then on (server_mgr.sim.decode)


@dataclass(slots=True)
class Counters:
    """Tokenizer-side totals (the ``sglang:*_total`` counters)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests: int = 0
    aborted_requests: int = 0


@dataclass(eq=False)
class SimState:
    """Shared state of the sim server."""

    cfg: SimConfig
    log: SimLog
    scheduler: Scheduler
    status: Status = "Starting"
    shutting_down: bool = False
    faults: Faults = field(default_factory=Faults)
    counters: Counters = field(default_factory=Counters)
    chat_requests: int = 0
    loads_reads: int = 0  # GET /v1/loads answered (a test counts what the load watch asks)
    metrics_reads: int = 0  # GET /metrics answered
    inflight: dict[str, SimRequest] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    health_changed: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int = 0

    def set_health_stall(self, on: bool) -> None:
        self.faults.health_stall = on
        self.health_changed.set()

    def set_stall_streams(self, on: bool) -> None:
        self.faults.stall_streams = on
        self.scheduler.paused = on
        if not on:
            self.scheduler.resume()

    def record_finish(self, req: SimRequest) -> None:
        """Count a finished request in the tokenizer-side totals."""
        c = self.counters
        c.requests += 1
        c.prompt_tokens += req.prompt_tokens
        c.generation_tokens += req.generated
        if req.finish_reason == "abort":
            c.aborted_requests += 1


STATE = web.AppKey("sim_state", SimState)
