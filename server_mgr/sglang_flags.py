"""SGLang 0.5.x's command-line vocabulary, as far as the server manager emits or checks it.

Read from the argument parsers of the sglang 0.5.5, 0.5.10, 0.5.16 and 0.5.23 wheels (what
tokenmill relies on is summed up in docs/architecture.md, section 7). Every flag the manager
emits must be accepted by each of those parsers.
"""

from __future__ import annotations

# --kv-cache-dtype choices of 0.5.23 (0.5.10 had fp4_e2m1 instead of mxfp8/nvfp4/fp4_mx_block16).
KV_CACHE_DTYPES = "auto fp8_e5m2 fp8_e4m3 mxfp8 bf16 bfloat16 nvfp4 fp4_mx_block16".split()
# Quantized KV caches measurably change greedy outputs (the workload this project was born from
# had to roll FP8 KV back), so they need an explicit opt-in.
LOSSLESS_KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16")

# --reasoning-parser: the 0.5.10 choices plus the 0.5.23 additions the contract names.
REASONING_PARSERS = (
    "deepseek-r1 deepseek-v3 glm45 gpt-oss kimi kimi_k2 mimo qwen3 qwen3-thinking minimax "
    "minimax-append-think step3 step3p5 mistral nemotron_3 interns1 auto deepseek-v4 hunyuan kimi_k3 gemma4"
).split()

# --tool-call-parser: SGLang 0.5.23's choices (FunctionCallParser.ToolCallParserEnum), and "auto".
TOOL_CALL_PARSERS = (
    "auto apertus2509 beam cohere_command4 deepseekv3 deepseekv31 deepseekv32 deepseekv4 deepseekv41 dots "
    "glm glm45 glm47 gpt-oss k2_horizon kimi_k2 kimi_k3 lfm2 ling3 llama3 mimo minicpm5 mistral muse "
    "poolside_v1 pythonic qwen qwen25 qwen3_coder spark25 step3 step3p5 minimax-m2 minimax-m3 nanbeige "
    "trinity interns1 hermes hunyuan gigachat3 gigachat35 gemma4 inkling iquest_q1 response_template"
).split()

# Flags the config owns: giving them in extra_args would duplicate or contradict a config key
# (and --mem-fraction-static would defeat the OOM remediation, --api-key would leak in logs).
MANAGED_FLAGS: dict[str, str] = {
    "--model-path": "model_path",
    "--model": "model_path",
    "--served-model-name": "served_model_name",
    "--host": "host",
    "--port": "port",
    "--tp-size": "tp_size",
    "--tensor-parallel-size": "tp_size",
    "--dp-size": "dp_size",
    "--data-parallel-size": "dp_size",
    "--mem-fraction-static": "mem_fraction_static",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--enable-hierarchical-cache": "enable_hierarchical_cache",
    "--enable-hicache": "enable_hierarchical_cache",
    "--hicache-size": "hicache_size",
    "--context-length": "context_length",
    "--max-running-requests": "max_running_requests",
    "--reasoning-parser": "reasoning_parser",
    "--tool-call-parser": "tool_call_parser",
    "--enable-metrics": "enable_metrics",
    "--cuda-graph-backend-decode": "cuda_graphs",
    "--cuda-graph-backend-prefill": "cuda_graphs",
    "--api-key": "api_key / api_key_env",
}

# Flags that some 0.5.x parser refuses, with what to use instead.
REFUSED_FLAGS: dict[str, str] = {
    "--tp": "'--tp' is only an argparse abbreviation of --tp-size, not an alias; set tp_size",
    "--dp": "'--dp' is only an argparse abbreviation of --dp-size, not an alias; set dp_size",
    "--cuda-graph-max-bs": (
        "'--cuda-graph-max-bs' was removed in sglang 0.5.23; use --cuda-graph-max-bs-decode "
        "(and --cuda-graph-max-bs-prefill)"
    ),
}

# Other flags of the 0.5.x parsers (contract §1.2), used to catch abbreviations of real flags.
OTHER_FLAGS = (
    "--tokenizer-path --base-gpu-id --gpu-id-step --hicache-ratio --max-queued-requests --max-total-tokens "
    "--chunked-prefill-size --stream-interval --admin-api-key --watchdog-timeout --soft-watchdog-timeout "
    "--log-level --log-level-http --decode-log-interval --cuda-graph-max-bs-decode "
    "--cuda-graph-max-bs-prefill --cuda-graph-config --disable-cuda-graph --disable-decode-cuda-graph "
    "--disable-prefill-cuda-graph --schedule-policy --random-seed --skip-server-warmup --trust-remote-code "
    "--allow-auto-truncate --enable-cache-report --stream-response-default-include-usage "
    "--incremental-streaming-output --attn-dp-size --enable-dp-attention --tokenizer-worker-num --device "
    "--dtype --load-format --attention-backend --sampling-backend --sleep-on-idle"
).split()


def extra_args_problem(args: tuple[str, ...]) -> str | None:
    """Why ``args`` cannot be passed to SGLang, or None if every flag in it is acceptable."""
    known = (*MANAGED_FLAGS, *OTHER_FLAGS)
    for arg in args:
        if not arg.startswith("--"):
            if arg.startswith("-") and not _is_number(arg):
                return f"{arg!r}: SGLang has no short options; use the full --flag name"
            continue
        flag = arg.split("=", 1)[0]
        if flag in REFUSED_FLAGS:
            return REFUSED_FLAGS[flag]
        if flag in MANAGED_FLAGS:
            return f"{flag!r} is set by the config key {MANAGED_FLAGS[flag]}, not extra_args"
        longer = [k for k in known if k.startswith(flag) and k != flag]
        if longer and flag not in known:
            return f"{flag!r} is an abbreviation of {longer[0]}; spell the flag out"
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
