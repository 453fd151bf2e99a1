"""tokenmill's contract with SGLang, one test body for both engines: the sim and SGLang 0.5.23.

Each test runs against the sim and against real SGLang (the tiny CPU model; ``make sglang-env``).
Where the two differ the sim is wrong; what was found and fixed is listed in
``docs/sglang-conformance.md``. The engines here are the session's shared plain engines
(``tests.engines.PLAIN_FLAGS``: an API key, ``--enable-metrics``, no parser).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import urllib.request
from pathlib import Path

import pytest

from tests.engines import (
    API_KEY,
    CONTEXT_LEN,
    MAX_TOTAL_TOKENS,
    Engine,
)
from tests.procs import http_status, wait_for
from tests.sglang_client import chat, client, get_json, post_json, sse_frames, stream, stream_options
from tokenmill import capacity, errors
from tokenmill.server_report import parse_metrics
from workers.event_loop import run as run_on_worker_loop
from workers.stream import Progress, stream_chat

MODEL = "tm-model"
USER = [{"role": "user", "content": "Tell me about caches and queues. Ünïcödé δέλτα 日本語 🚀"}]


@pytest.fixture(scope="module")
def engine(plain_engine: Engine) -> Engine:
    return plain_engine


def greedy(max_tokens: int, messages: list[dict] | None = None) -> dict:
    return {"model": MODEL, "messages": messages or USER, "max_tokens": max_tokens, "temperature": 0}


def test_a_stream_is_role_then_deltas_then_a_finish_chunk_then_usage_then_done(engine: Engine) -> None:
    frames = sse_frames(engine, {**greedy(12), **stream_options()})

    assert frames[-1] == "[DONE]"
    chunks = frames[:-1]
    role, *deltas, finish, usage = chunks
    assert role["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert role["choices"][0]["finish_reason"] is None and "usage" not in role
    assert deltas and all(d["choices"][0]["delta"].get("content") for d in deltas)
    counts = [d["usage"]["completion_tokens"] for d in deltas]  # continuous_usage_stats
    assert counts == sorted(counts) and len(set(counts)) == len(counts), counts
    assert finish["choices"][0]["delta"] == {"reasoning_content": None}
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["choices"][0]["matched_stop"] is None and "usage" not in finish
    assert usage["choices"] == []
    u = usage["usage"]
    assert u["completion_tokens"] == 12 == counts[-1]
    assert u["total_tokens"] == u["prompt_tokens"] + 12
    assert {d["usage"]["prompt_tokens"] for d in deltas} == {u["prompt_tokens"]}
    assert len({c["id"] for c in chunks}) == 1 and re.fullmatch(r"[0-9a-f]{32}", chunks[0]["id"])
    assert {c["model"] for c in chunks} == {MODEL}
    assert len({c["created"] for c in chunks}) == 1
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


def test_a_requests_rid_becomes_the_id_of_every_chunk(engine: Engine) -> None:
    frames = sse_frames(engine, {**greedy(4), "rid": "run-a/job-1/2"})

    assert {f["id"] for f in frames[:-1]} == {"run-a/job-1/2"}


def test_tokenmills_stream_has_exact_usage_and_the_non_streamed_text(engine: Engine) -> None:
    progress = stream(engine, greedy(24))
    answer = chat(engine, USER, max_tokens=24, temperature=0)

    assert progress.finish_reason == "length" == answer["choices"][0]["finish_reason"]
    assert progress.tokens == 24 == answer["usage"]["completion_tokens"]
    assert progress.usage is not None
    assert progress.usage["prompt_tokens"] == answer["usage"]["prompt_tokens"] > 0
    assert "".join(progress.content) == answer["choices"][0]["message"]["content"]
    assert answer["choices"][0]["message"]["reasoning_content"] is None


def test_greedy_output_is_the_same_alone_and_inside_a_batch(engine: Engine) -> None:
    prompts = [[{"role": "user", "content": f"prompt {i}: {'δ' * i} tell me more"}] for i in range(12)]

    def answer(messages: list[dict]) -> str:
        return chat(engine, messages, max_tokens=16, temperature=0)["choices"][0]["message"]["content"]

    alone = [answer(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        batch = list(pool.map(answer, prompts))

    assert batch == alone
    assert len(set(alone)) == len(alone), "every prompt has an output of its own"


def test_an_over_long_prompt_is_a_context_length_error_with_sglangs_text(engine: Engine) -> None:
    long_prompt = [{"role": "user", "content": "word " * 9000}]
    with pytest.raises(errors.ContextLengthError) as input_too_long:
        stream(engine, greedy(8, long_prompt))
    with pytest.raises(errors.ContextLengthError) as total_too_long:
        stream(engine, greedy(CONTEXT_LEN - 2))

    assert input_too_long.value.status == 400
    assert re.fullmatch(
        rf"The input \(\d+ tokens\) is longer than the model's context length \({CONTEXT_LEN} tokens\)\.",
        input_too_long.value.message,
    ), input_too_long.value.message
    m = re.fullmatch(
        rf"Requested token count exceeds the model's maximum context length of {CONTEXT_LEN} tokens\. "
        rf"You requested a total of (\d+) tokens: (\d+) tokens from the input messages and "
        rf"{CONTEXT_LEN - 2} tokens for the completion\. Please reduce the number of tokens in the "
        r"input messages or the completion to fit within the limit\.",
        total_too_long.value.message,
    )
    assert m and int(m[1]) == int(m[2]) + CONTEXT_LEN - 2, total_too_long.value.message


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": -1}, "temperature must be a non-negative finite number, got -1.0."),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"max_tokens": -3}, "max_new_tokens must be at least 0, got -3."),
        ({"top_k": 0, "temperature": 0.7}, "top_k must be -1 (disable) or at least 1, got 0."),
        ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3.0."),
    ],
    ids=["temperature", "top_p-zero", "top_p-above-one", "max_tokens", "top_k", "frequency_penalty"],
)
def test_invalid_sampling_values_are_terminal_with_sglangs_messages(
    engine: Engine, params: dict, message: str
) -> None:
    with pytest.raises(errors.InvalidRequestError) as refused:
        stream(engine, {**greedy(8), **params})

    assert refused.value.status == 400
    assert refused.value.message == message


def test_greedy_decoding_ignores_top_k(engine: Engine) -> None:
    assert stream(engine, {**greedy(4), "top_k": 0}).tokens == 4  # SGLang sets top_k = 1 first


def test_the_api_key_is_required_except_on_health_and_metrics(engine: Engine) -> None:
    status, body = post_json(engine, "/v1/chat/completions", greedy(4), auth=False)
    with pytest.raises(errors.AuthError) as refused:
        stream(engine, greedy(4), api_key="not-the-key")

    assert (status, body) == (401, {"error": "Unauthorized"})
    assert refused.value.status == 401 and refused.value.message == "Unauthorized"
    assert http_status(f"{engine.url}/health", timeout=30) == 200
    assert http_status(f"{engine.url}/metrics") == 200


def test_server_info_states_the_kv_pool_and_tokenmill_finds_the_context_length(engine: Engine) -> None:
    status, info = get_json(engine, "/server_info")
    _, models = get_json(engine, "/v1/models")

    assert status == 200
    assert info["max_total_num_tokens"] == MAX_TOTAL_TOKENS
    assert info["context_length"] is None, "the flag as given: the tiny model's own length is used"
    assert info["max_req_input_len"] == min(CONTEXT_LEN - 1, MAX_TOTAL_TOKENS - 1) - 5
    assert info["version"] == "0.5.23"
    assert models["data"][0]["max_model_len"] == CONTEXT_LEN
    assert capacity.fetch(engine.url, API_KEY, 30) == (MAX_TOTAL_TOKENS, CONTEXT_LEN)
    assert get_json(engine, "/server_info", auth=False)[0] == 401


def test_a_client_that_disconnects_mid_stream_has_its_request_aborted(engine: Engine) -> None:
    async def start_then_drop() -> int:
        c = client(engine)
        progress = Progress()
        task = asyncio.ensure_future(stream_chat(c, greedy(4000), {}, progress))
        while progress.tokens < 5:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.02)
        running = _running(engine)
        task.cancel()  # closes the connection
        await asyncio.gather(task, return_exceptions=True)
        await c.close()
        return running

    assert run_on_worker_loop(start_then_drop()) == 1
    wait_for(lambda: _running(engine) == 0, 20, "the server to abort the dropped request")


def test_streams_share_a_kept_alive_connection_which_the_server_closes_after_5s_idle(engine: Engine) -> None:
    def established() -> int:  # open connections to the engine (only this test's client makes any)
        rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
        # each row: slot, local address, remote address (hex ip:port), state (01: ESTABLISHED), ...
        return sum(
            1 for r in rows if int(r.split()[2].split(":")[1], 16) == engine.port and r.split()[3] == "01"
        )

    async def go() -> tuple[int, float, int]:
        c = client(engine)
        c.http.idle_s = 60.0  # keep it idle past the server's own keep-alive: the server closes it
        loop = asyncio.get_running_loop()
        try:
            for _ in range(3):
                assert (await stream_chat(c, greedy(4), {}, Progress())).tokens == 4
            back_to_back = established()
            since = loop.time()
            while established():
                assert loop.time() - since < 20, "the server kept an idle connection open for 20 s"
                await asyncio.sleep(0.05)
            closed_after = loop.time() - since
            assert (await stream_chat(c, greedy(4), {}, Progress())).tokens == 4
            return back_to_back, closed_after, established()
        finally:
            await c.close()

    back_to_back, closed_after, after = run_on_worker_loop(go())

    assert back_to_back == 1
    assert 4 <= closed_after <= 8, closed_after  # SGLANG_TIMEOUT_KEEP_ALIVE: 5 s
    assert after == 1  # the stream after it opened a new connection


def test_metrics_report_the_schedulers_figures_by_sglangs_names(engine: Engine) -> None:
    stream(engine, greedy(40))  # something for the gauges to have seen
    figures = parse_metrics(_metrics_text(engine))

    for name in ("running_req", "queue_req", "token_usage", "gen_throughput", "retracted_reqs"):
        assert name in figures, (name, sorted(figures))
    assert 0 <= figures["token_usage"] <= 1
    # the retraction counter exists only once a retraction happened (none can in a 20000-token
    # pool with these requests): a reader must take its absence as zero
    assert "retractions" not in figures


def test_a_partial_answer_is_continued_and_the_token_counts_add_up(engine: Engine) -> None:
    full = chat(engine, USER, max_tokens=32, temperature=0)
    text = full["choices"][0]["message"]["content"]
    partial = text[: len(text) // 2]
    messages = [*USER, {"role": "assistant", "content": partial}]
    cont = chat(engine, messages, max_tokens=16, temperature=0, continue_final_message=True)

    assert cont["choices"][0]["finish_reason"] == "length"
    assert cont["usage"]["completion_tokens"] == 16
    assert cont["usage"]["prompt_tokens"] > full["usage"]["prompt_tokens"]
    assert cont["choices"][0]["message"]["content"], "the continuation adds text"


def _running(engine: Engine) -> int:
    status, loads = get_json(engine, "/v1/loads")
    assert status == 200, loads
    return sum(int(item["num_running_reqs"]) + int(item["num_waiting_reqs"]) for item in loads["loads"])


def _metrics_text(engine: Engine) -> str:
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=30) as resp:
        return resp.read().decode()


def test_a_continuations_prompt_holds_the_partial_answer_and_leaves_its_turn_open(engine: Engine) -> None:
    # Given the engine's own first 8 greedy tokens of an answer, as a checkpoint holds them
    head = chat(engine, USER, max_tokens=8, temperature=0)
    partial = head["choices"][0]["message"]["content"]
    with_partial = [*USER, {"role": "assistant", "content": partial}]

    # When it is continued, and the same messages are sent as a closed turn instead
    cont = chat(engine, with_partial, max_tokens=4, temperature=0, continue_final_message=True)
    closed = chat(engine, with_partial, max_tokens=1, temperature=0)

    # Then the continuation's prompt is the request's plus the partial's 8 tokens (less at most
    # the generation prompt's "<think>", which a continued turn has not), and its turn is left
    # open: a closed turn adds the turn's end and a new generation prompt. (Its text is not
    # compared with an uninterrupted run's: the tiny model's output holds cut UTF-8, which
    # tokenizes back differently.)
    plain_prompt = head["usage"]["prompt_tokens"]
    cont_prompt = cont["usage"]["prompt_tokens"]
    assert head["usage"]["completion_tokens"] == 8
    assert cont_prompt - plain_prompt >= 8 - 1, (plain_prompt, cont_prompt)
    assert closed["usage"]["prompt_tokens"] > cont_prompt, "continue_final_message was ignored"
    assert cont["usage"]["completion_tokens"] == 4 and cont["choices"][0]["message"]["content"]
