"""Native and info endpoints: health, readiness, server/model info, models, loads and control.

Shapes follow SGLang 0.5.23 (contract §2). ``/_sim/*`` are the sim's own test hooks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import orjson
from aiohttp import web

from server_mgr.sim import faults, logs
from server_mgr.sim.chat import json_response
from server_mgr.sim.config import (
    CHUNKED_PREFILL_SIZE,
    MAX_PREFILL_TOKENS,
    VERSION,
    WEIGHTS_GB,
)
from server_mgr.sim.decode import DEGRADES
from server_mgr.sim.state import STATE, SimState


def _empty(status: int) -> web.Response:
    return web.Response(status=status)


async def health(request: web.Request) -> web.Response:
    """``/health`` and ``/health_generate``: empty body; 200 after a ~1 s probe when Up (§2.2)."""
    state = request.app[STATE]
    if state.shutting_down:
        state.log.info("Health check request received during shutdown. Returning 503.")
        return _empty(503)
    if state.status == "Starting":
        return _empty(503)
    tic = time.time()
    await asyncio.sleep(state.cfg.health_latency_s)
    if state.faults.health_stall and not await _wait_unstalled(state, tic):
        state.status = "UnHealthy"
        state.log.error(
            "Health check failed. Server couldn't get a response from detokenizer for last "
            f"{state.cfg.health_timeout_s:g} seconds. tic start time: "
            f"{time.strftime('%H:%M:%S', time.localtime(tic))}. last_heartbeat time: "
            f"{time.strftime('%H:%M:%S', time.localtime(tic))}"
        )
        return _empty(503)
    if state.shutting_down:
        return _empty(503)
    state.status = "Up"
    state.scheduler.log_health_probe()
    return _empty(200)


async def _wait_unstalled(state: SimState, tic: float) -> bool:
    """Hang like a wedged server until the fault is lifted; False after the health timeout."""
    while state.faults.health_stall:
        remaining = tic + state.cfg.health_timeout_s - time.time()
        if remaining <= 0:
            return False
        state.health_changed.clear()
        try:
            await asyncio.wait_for(state.health_changed.wait(), remaining)
        except TimeoutError:
            return False
    return True


async def ready(request: web.Request) -> web.Response:
    """``/ready``: 200 when Up and not shutting down; no generation (§2.3)."""
    state = request.app[STATE]
    return _empty(200 if state.status == "Up" and not state.shutting_down else 503)


async def ping(request: web.Request) -> web.Response:
    return _empty(200 if request.app[STATE].status == "Up" else 503)


def server_args(state: SimState) -> dict[str, Any]:
    """The resolved server args, flattened as SGLang puts them in /server_info."""
    cfg = state.cfg
    return {
        "model_path": cfg.model_path,
        "tokenizer_path": cfg.model_path,
        "served_model_name": cfg.model_name,
        "host": cfg.host,
        "port": cfg.port,
        "tp_size": cfg.tp_size,
        "dp_size": 1,
        "pp_size": 1,
        "context_length": cfg.context_length,
        "mem_fraction_static": cfg.mem_fraction_static,
        "max_running_requests": cfg.max_running_requests,
        "max_queued_requests": cfg.max_queued_requests,
        "max_total_tokens": cfg.max_total_tokens,
        "chunked_prefill_size": CHUNKED_PREFILL_SIZE,
        "max_prefill_tokens": MAX_PREFILL_TOKENS,
        "kv_cache_dtype": "auto",
        "schedule_policy": "fcfs",
        "stream_interval": cfg.stream_interval,
        "decode_log_interval": cfg.decode_log_interval,
        "reasoning_parser": cfg.reasoning_parser,
        "tool_call_parser": cfg.tool_call_parser,
        "enable_metrics": cfg.enable_metrics,
        "allow_auto_truncate": cfg.allow_auto_truncate,
        "skip_server_warmup": cfg.skip_server_warmup,
        "log_level": cfg.log_level,
        "random_seed": cfg.seed,
        "api_key": None if cfg.api_key is None else "***",
    }


def server_info(state: SimState) -> dict[str, Any]:
    """The /server_info body: args, scheduler info, ``internal_states`` and ``version``."""
    cfg = state.cfg
    args = server_args(state)
    memory = {
        "weight": round(WEIGHTS_GB, 2),
        "kvcache": round(logs.kv_gb(cfg), 2),
        "token_capacity": cfg.max_total_tokens,
        "graph": {"decode": round(logs.graph_gb(cfg), 2)},
        "startup_available": round(logs.available_after_pool_gb(cfg), 2),
        "token_capacity_swa": None,
    }
    internal = {
        **args,
        "last_gen_throughput": state.scheduler.snapshot.gen_throughput,
        "memory_usage": memory,
        "world_size": cfg.tp_size,
        "effective_max_running_requests_per_dp": cfg.max_running_requests,
        "startup_time": state.started_at,
        "disaggregation_mode": "null",
    }
    return {
        **args,
        "max_total_num_tokens": cfg.max_total_tokens,
        "max_req_input_len": cfg.max_req_input_len,
        "status": "ready",
        "internal_states": [internal],
        "version": VERSION,
        "startup_time": state.started_at,
        "frontend": "python",
    }


def model_info(state: SimState) -> dict[str, Any]:
    cfg = state.cfg
    return {
        "model_path": cfg.model_path,
        "tokenizer_path": cfg.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "served_model_name": cfg.model_name,
        "load_format": "auto",
        "reasoning_parser": cfg.reasoning_parser,
        "tool_call_parser": cfg.tool_call_parser,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }


def _deprecated(state: SimState, old: str, new: str) -> None:
    state.log.warning(
        f"Endpoint '{old}' is deprecated and will be removed in a future version. Please use '{new}' instead."
    )


async def get_server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if request.path == "/get_server_info":
        _deprecated(state, "/get_server_info", "/server_info")
    return json_response(server_info(state))


async def get_model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if request.path == "/get_model_info":
        _deprecated(state, "/get_model_info", "/model_info")
    return json_response(model_info(state))


def _model_card(state: SimState) -> dict[str, Any]:
    name = state.cfg.model_name
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",
        "root": name,
        "parent": None,
        "max_model_len": state.cfg.context_len,
    }


async def list_models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_model_card(request.app[STATE])]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["name"]
    if name == state.cfg.model_name:
        return json_response(_model_card(state))
    err = {
        "message": f"The model '{name}' does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    return json_response({"error": err}, 404)


async def loads(request: web.Request) -> web.Response:
    """``/v1/loads``: the scheduler's last published load snapshot (0.5.23 field names; it lags
    the scheduler by up to ``--load-snapshot-publish-interval`` decode steps, as SGLang's does)."""
    state = request.app[STATE]
    state.loads_reads += 1
    s = state.scheduler
    snap = s.load
    load = {
        "timestamp": snap.timestamp,
        "dp_rank": 0,
        "num_running_reqs": snap.running,
        "num_waiting_reqs": snap.waiting,
        "num_used_tokens": snap.used_tokens,
        "num_total_tokens": s.capacity,
        "max_total_num_tokens": s.capacity,
        "max_running_requests": state.cfg.max_running_requests,
        "token_usage": round(snap.used_tokens / s.capacity, 4) if s.capacity else 0.0,
        "gen_throughput": s.snapshot.gen_throughput,
        "cache_hit_rate": 0.0,
        "utilization": 1.0 if s.running else 0.0,
    }
    return json_response(
        {
            "timestamp": time.time(),
            "version": VERSION,
            "accelerator": "cuda",
            "num_accelerators": state.cfg.tp_size,
            "loads": [load],
        }
    )


async def flush_cache(request: web.Request) -> web.Response:
    state = request.app[STATE]
    s = state.scheduler
    if s.running or s.waiting:
        state.log.warning(
            "Cache not flushed because there are pending requests. "
            f"#queue-req: {len(s.waiting)}, #running-req: {len(s.running)}",
            rank=True,
        )
        return web.Response(status=400, text="Flush cache failed.\n")
    return web.Response(
        text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
        "or waiting requests, the operation will not be performed.)\n"
    )


async def abort_request(request: web.Request) -> web.Response:
    """``/abort_request``: by rid prefix, or ``abort_all``; always 200 with an empty body."""
    state = request.app[STATE]
    try:
        body = orjson.loads(await request.read() or b"{}")
    except orjson.JSONDecodeError as exc:
        return json_response({"error": {"message": str(exc)}}, 400)
    rid = str(body.get("rid") or "") if isinstance(body, dict) else ""
    abort_all = bool(isinstance(body, dict) and body.get("abort_all"))
    if not rid and not abort_all:
        state.log.warning("abort_request with an empty rid and abort_all=False is ignored.")
    state.scheduler.abort(rid, abort_all=abort_all)
    return _empty(200)


async def sim_fault(request: web.Request) -> web.Response:
    """``POST /_sim/fault``: toggle runtime faults (see the package docstring)."""
    state = request.app[STATE]
    body = orjson.loads(await request.read() or b"{}")
    if not isinstance(body, dict):
        return json_response({"error": "expected a JSON object"}, 400)
    if body.get("crash"):
        faults.crash(state.log)
    if "health_stall" in body:
        state.set_health_stall(bool(body["health_stall"]))
    if "stall_streams" in body:
        state.set_stall_streams(bool(body["stall_streams"]))
    if "ignore_stop" in body:
        state.faults.ignore_stop = bool(body["ignore_stop"])
    if "degrade" in body:
        if body["degrade"] not in (None, *DEGRADES):
            return json_response({"error": f"degrade must be one of {', '.join(DEGRADES)} or null"}, 400)
        state.faults.degrade = body["degrade"]
    return json_response(dataclasses.asdict(state.faults))


async def sim_stats(request: web.Request) -> web.Response:
    """``GET /_sim/stats``: scheduler internals for tests (peak KV use, retractions)."""
    state = request.app[STATE]
    s = state.scheduler
    return json_response(
        {
            "status": state.status,
            "capacity": s.capacity,
            "used_tokens": s.used_tokens,
            "peak_used_tokens": s.peak_used_tokens,
            "running": len(s.running),
            "running_generated": [r.generated for r in s.running],
            "queued": len(s.waiting),
            "retracted_total": s.retracted_total,
            "generated_total": s.generated_total,
            "new_token_ratio": s.new_token_ratio,
            "chat_requests": state.chat_requests,
            "loads_reads": state.loads_reads,
            "metrics_reads": state.metrics_reads,
            "inflight": len(state.inflight),
        }
    )
