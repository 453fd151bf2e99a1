"""The ``sim`` engine: an SGLang-compatible HTTP server without a GPU, for tests, demos, benchmarks.

It follows SGLang 0.5.23's HTTP and process contract (docs/architecture.md, section 7): the
startup timeline, ``/health`` and ``/server_info``, the chat SSE shapes, errors with their exact
texts, a KV-pool scheduler with retraction, the Prefill/Decode log lines and the SIGTERM drain.
Its output is deterministic (:mod:`server_mgr.sim.textgen`), so tests check every byte.

Modules: ``cli`` (flags), ``lifecycle`` (startup, signals), ``app`` (routes, auth), ``chat``
(the chat endpoint), ``endpoints`` (the rest), ``validation`` (request checks), ``options``
(generation options: stop, grammars, tools, logprobs, token ids), ``errors``, ``textgen`` (free
text), ``decode`` (the output once options apply), ``schemagen``/``ebnf``/``toolcalls`` (grammar
outputs), ``tokens`` (token pieces, ids, log-probabilities), ``render`` (chunks and bodies),
``scheduler`` (KV model), ``sse`` (chunk bytes), ``metrics``, ``logs``, ``faults``.

Test hooks, never on the real server and exempt from ``--api-key``:

``POST /_sim/fault`` with a JSON object; each key is optional:

- ``{"health_stall": true}``: /health hangs like a wedged server until set back to ``false``
  (after ``--sim-health-timeout-s``, 20 s as in SGLang, it answers 503 and logs the
  ``Health check failed`` line);
- ``{"stall_streams": true}``: the scheduler stops stepping, so every stream goes silent and new
  requests queue, until set back to ``false``;
- ``{"ignore_stop": true}``: requests are answered as if they had no ``stop`` strings (their
  text runs past them, as real SGLang's now and then does), until set back to ``false``;
- ``{"degrade": "loop" | "truncate" | "broken_json" | "empty"}``: the answers to requests that
  arrive from then on degrade as a broken server's do (a loop to ``max_tokens``, no EOS, output
  that breaks its ``response_format``/``regex``/tool schema, no answer; details in
  :mod:`server_mgr.sim.decode`), until set back to ``null``;
- ``{"crash": true}``: log SGLang's scheduler-crash lines and SIGKILL the process.

It answers ``{"health_stall": bool, "stall_streams": bool, "ignore_stop": bool, "degrade": str |
null}``.

``GET /_sim/stats``: ``capacity``, ``used_tokens``, ``peak_used_tokens``, ``running``,
``queued``, ``retracted_total``, ``generated_total``, ``new_token_ratio``, ``chat_requests``,
``loads_reads`` and ``metrics_reads`` (the ``/v1/loads`` and ``/metrics`` pages answered),
``inflight``, ``status``.
"""
