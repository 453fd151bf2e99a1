"""A job's exported text never holds a stop string it asked to stop at, whatever the server sent.

The rule is one pure function (``tokenmill.outputs.cut_at_stop``) that every finished attempt
goes through: streamed, answered whole, and continued from a checkpoint after a crash. The sim's
``ignore_stop`` fault answers as if a request had no stop strings, as real SGLang now and then
lets one through.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import redis

from tests.chaos import mid_stream, results, wait_finished
from tests.pipeline import cli, read_export, write_jsonl
from tests.procs import Proc, start_sim, start_worker, wait_for, worker_env
from tokenmill import keys
from tokenmill.outputs import StopCut, cut_at_stop, tokens_through
from tokenmill.transitions import Checkpoint, Claim
from workers.attempt import _outcome
from workers.stream import Progress
from workers.watch import AttemptState

NEVER = "\u2603"  # a stop string the sim never writes
PROMPT = "tell me about the weather in a few words"


# --- the rule -----------------------------------------------------------------------------------


def test_the_text_ends_before_the_first_stop_string_in_it_whatever_the_lists_order() -> None:
    assert cut_at_stop("one two three", "", ["three", "two", NEVER]) == StopCut("one ", "", "two")


def test_of_overlapping_stop_strings_the_one_that_ends_first_is_the_cut_so_none_is_left() -> None:
    # "e" is first in the list, but "s" ends first: SGLang trims at "e" when one token writes
    # "se", and "ros" keeps an "s" (a cause of the leaks seen on real SGLang with these stops)
    assert cut_at_stop("rose garden", "", ["e", "s"]) == StopCut("ro", "", "s")
    # a short stop string inside a long one ends before it
    assert cut_at_stop("say hello world", "", ["hello world", "o"]) == StopCut("say hell", "", "o")
    # two that end together: the first in the list, as SGLang picks at one step
    assert cut_at_stop("xabcx", "", ["abc", "bc"]) == StopCut("x", "", "abc")
    assert cut_at_stop("xabcx", "", ["bc", "abc"]) == StopCut("xa", "", "bc")


def finished(
    request: dict[str, Any], finish: str, base: Checkpoint | None = None, **progress: Any
) -> dict[str, Any]:
    """The result an attempt commits (``workers.attempt._outcome``) for what the server sent."""
    base = base or Checkpoint()
    claim = Claim("r", "P:j", "t", 2, {"request": request}, base, "P", "short", 0)
    state = AttemptState(base=base, progress=Progress(**progress))
    return _outcome(claim, {"model": "m", **request}, state, finish, 0.0).result


def ending(result: dict[str, Any]) -> tuple[str, str, Any]:
    return result["content"], result["finish_reason"], result.get("matched_stop")


def test_a_stop_string_across_the_checkpoint_seam_cuts_where_it_began_in_the_checkpoint() -> None:
    # Given a checkpoint ending with the start of a stop string, and a continuation that wrote
    # its rest and ran on (SGLang does not see a stop string that began in its prompt)
    base = Checkpoint(content="The answer is EN", tokens=4, prompt_tokens=9)
    # When the attempt finishes
    result = finished({"stop": ["END"]}, "length", base, content=["D. ", "More"], chunks=2)
    # Then the text ends where the stop string began, inside the checkpoint, ended by it
    assert ending(result) == ("The answer is ", "stop", "END")


def test_a_continuation_after_a_stop_string_the_first_attempt_wrote_is_cut_at_that_one() -> None:
    # Given a checkpoint that already holds a stop string, continued with another
    base = Checkpoint(content="Fine.END then", tokens=4, prompt_tokens=9)
    # When the attempt finishes (the server ended it on its EOS token)
    result = finished({"stop": ["more", "END"]}, "stop", base, content=[" more"], chunks=1, matched_stop=7)
    # Then the text ends at the checkpoint's stop string, the first in the text
    assert ending(result) == ("Fine.", "stop", "END")


def test_a_cut_answer_sent_whole_keeps_the_logprobs_and_ids_of_the_tokens_through_the_stop() -> None:
    # Given a whole answer that ran past its stop string "s", one entry per token
    entries = [{"token": t, "logprob": -0.5, "top_logprobs": []} for t in ("ro", "se", " gar", "den")]
    request = {"stop": "s", "logprobs": True, "return_token_ids": True}
    # When the attempt finishes
    result = finished(request, "length", content=["rose garden"], logprobs=entries, output_ids=[1, 2, 3, 4],
                      usage={"prompt_tokens": 5, "completion_tokens": 4})  # fmt: skip
    # Then the tokens through the one that completed the stop string are kept, and counted
    assert result["content"] == "ro" and result["matched_stop"] == "s"
    assert result["logprobs"]["content"] == entries[:2] and result["output_token_ids"] == [1, 2]
    assert result["usage"]["completion_tokens"] == 2


def test_tool_calls_are_left_as_they_came_when_the_content_is_cut() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    request = {"stop": "!", "tools": [{"type": "function", "function": {"name": "f"}}]}
    result = finished(request, "tool_calls", content=["Calling! now"], chunks=2, tool_calls=[call])
    assert result["content"] == "Calling" and result["finish_reason"] == "tool_calls"
    assert result["tool_calls"] == [call]


def test_with_no_stop_trim_the_stop_string_stays_only_at_the_very_end() -> None:
    assert cut_at_stop("rose garden", "", ["e", "s"], keep=True) == StopCut("ros", "", "s")
    # an output the server ended properly is left as it is
    assert cut_at_stop("the END", "", ["END"], keep=True) == StopCut("the END", "", "END")


def test_without_stop_strings_or_without_a_match_the_output_is_untouched() -> None:
    assert cut_at_stop("anything", "thought", []) == StopCut("anything", "thought", None)
    assert cut_at_stop("anything", "thought", [NEVER]) == StopCut("anything", "thought", None)


def test_stop_strings_match_unicode_text_by_characters() -> None:
    text = "δέλτα 日本語 emoji🙂 naïve"
    assert cut_at_stop(text, "", ["🙂", "本"]) == StopCut("δέλτα 日", "", "本")
    assert cut_at_stop(text, "", ["ï", "🙂"], keep=True) == StopCut("δέλτα 日本語 emoji🙂", "", "🙂")


def test_a_stop_string_in_the_reasoning_ends_the_output_there_and_leaves_no_content() -> None:
    # SGLang matches stop strings in everything it generates, the reasoning first
    assert cut_at_stop("the content", "I think. STOP more", ["STOP"]) == StopCut("", "I think. ", "STOP")
    assert cut_at_stop("the STOP content", "I think.", ["STOP"]) == StopCut("the ", "I think.", "STOP")


def test_the_tokens_kept_are_those_that_write_the_text_through_the_stop_string() -> None:
    # the token that completed the stop string is kept (SGLang counts it)
    assert tokens_through(["ro", "se", " gar", "den"], "rose garden", 3) == 2
    assert tokens_through(["ro", "se", " gar", "den"], "rose garden", 4) == 2
    assert tokens_through(["ro", "se", " gar", "den"], "rose garden", 5) == 3
    # token texts that do not spell the text (a special token) cannot be cut by it
    assert tokens_through(["<think>", "rose"], "rose garden", 3) is None


# --- on the sim, through real workers -------------------------------------------------------------


def post(url: str, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def sim_text(url: str, max_tokens: int, **options: Any) -> str:
    """What the sim writes for :data:`PROMPT`, greedy."""
    answer = post(url, "/v1/chat/completions", {
        "model": "default", "temperature": 0, "max_tokens": max_tokens, **options,
        "messages": [{"role": "user", "content": PROMPT}],
    })  # fmt: skip
    text: str = answer["choices"][0]["message"]["content"]
    return text


def leaky_sim(tmp_path: Path, procs: list[Proc], *flags: str) -> str:
    proc, url = start_sim(tmp_path, *flags)
    procs.append(proc)
    assert post(url, "/_sim/fault", {"ignore_stop": True})["ignore_stop"] is True
    return url


def enqueue(tmp_path: Path, env: dict[str, str], run: str, row: dict[str, Any], max_tokens: int) -> None:
    data = write_jsonl(tmp_path / f"{run}.jsonl", [{"id": "j", "prompt": PROMPT, **row}])
    cli("enqueue", str(data), "--run", run, "--partition", "P", "--temperature", "0",
        "--short-max-tokens", str(max_tokens), env=env)  # fmt: skip


def exported_row(tmp_path: Path, env: dict[str, str], run: str, redis_url: str) -> dict[str, Any]:
    """The one row of ``run``'s export, once its job is done."""
    wait_finished(redis.Redis.from_url(redis_url), run, 1, 60)
    cli("export", "--run", run, "--out", str(tmp_path / run), env=env)
    rows = read_export(tmp_path / run)["P"]
    assert len(rows) == 1, rows
    return rows[0]


def a_stop_in_the_middle(url: str, max_tokens: int) -> tuple[str, str]:
    """A stop string from the middle of what the sim writes, and that text cut before its first
    occurrence; the sim (its fault on) runs past it."""
    text = sim_text(url, max_tokens)
    assert len(text) > 20, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert text.find(stop) > 0, (text, stop)
    assert sim_text(url, max_tokens, stop=[stop]) == text, "the sim did not ignore the stop string"
    return stop, text[: text.find(stop)]


def test_a_streamed_answer_that_runs_past_its_stop_string_is_exported_cut_there(
    tmp_path: Path, redis_url: str, procs: list[Proc]
) -> None:
    # Given a server that ignores stop strings, and a job whose text holds one mid-way
    url = leaky_sim(tmp_path, procs)
    stop, want = a_stop_in_the_middle(url, 64)
    env = worker_env(redis_url, url)
    enqueue(tmp_path, env, "leak", {"stop": [NEVER, stop]}, 64)

    # When a worker streams it and the run is exported
    procs.append(start_worker(tmp_path, "short", env, concurrency=1))
    row = exported_row(tmp_path, env, "leak", redis_url)

    # Then the text ends where the stop string began, and the row says which one ended it
    assert row["messages"][-1]["content"] == want
    assert row["finish_reason"] == "stop" and row["matched_stop"] == stop


def test_an_answer_sent_whole_is_cut_at_its_stop_string_with_its_logprobs_and_tokens(
    tmp_path: Path, redis_url: str, procs: list[Proc]
) -> None:
    # Given a server that ignores stop strings, and a job answered whole (it asks for
    # log-probabilities and token ids) whose text holds a stop string mid-way
    url = leaky_sim(tmp_path, procs)
    stop, want = a_stop_in_the_middle(url, 64)
    env = worker_env(redis_url, url)
    enqueue(tmp_path, env, "whole", {"stop": stop, "logprobs": True, "return_token_ids": True}, 64)

    # When a worker runs it and the run is exported
    procs.append(start_worker(tmp_path, "short", env, concurrency=1))
    row = exported_row(tmp_path, env, "whole", redis_url)

    # Then the text is cut before the stop string, and the tokens through the one that completed
    # it are kept: its log-probabilities, its ids and its count
    assert row["messages"][-1]["content"] == want
    assert row["finish_reason"] == "stop" and row["matched_stop"] == stop
    tokens = [e["token"] for e in row["logprobs"]["content"]]
    assert len(tokens) == len(row["output_token_ids"]) == row["usage"]["completion_tokens"]
    assert len("".join(tokens[:-1])) < len(want + stop) <= len("".join(tokens))
    assert "".join(tokens).startswith(want + stop)


def test_a_job_whose_worker_was_killed_mid_stream_is_continued_and_exported_without_its_stop_string(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a server that ignores stop strings (streaming ~50 tokens a second), and a job whose
    # text holds a stop string early on
    url = leaky_sim(tmp_path, procs, "--sim-step-ms", "20", "--sim-mean-output-tokens", "150")
    text = sim_text(url, 150)
    assert len(text) > 100, text
    stop = text[12:15]
    want = text[: text.find(stop)]
    env = worker_env(redis_url, url)
    enqueue(tmp_path, env, "kill", {"stop": [stop, NEVER]}, 150)
    victim = start_worker(tmp_path, "short", env, concurrency=1)
    procs.append(victim)

    # When its worker is SIGKILLed once its checkpoint holds the stop string, and another worker
    # continues the job
    def checkpointed() -> bool:
        held = rclient.hget(keys.RunKeys("kill").job("P:j"), "ckpt_content") or b""
        return bool(mid_stream(rclient, "kill")) and stop in held.decode()

    wait_for(checkpointed, 30, "a checkpoint holding the stop string", 0.02)
    victim.kill()
    procs.append(start_worker(tmp_path, "short", env, concurrency=1))
    row = exported_row(tmp_path, env, "kill", redis_url)

    # Then the job was continued from its checkpoint, and its text ends before the stop string
    assert results(rclient, "kill", ["P:j"])["P:j"]["continued_tokens"] > 0
    assert row["messages"][-1]["content"] == want and stop not in row["messages"][-1]["content"]
    assert row["finish_reason"] == "stop" and row["matched_stop"] == stop
