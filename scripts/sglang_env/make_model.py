"""Write the tiny test model directory SGLang serves on a CPU-only machine (run with the SGLang
venv's python: it needs ``tokenizers``, ``transformers`` and ``torch``). Nothing is downloaded:
the tokenizer is a byte-level BPE trained on Python's own source files, and the weights are
random, drawn from a fixed seed and saved as safetensors.

Why not ``--load-format dummy``: its weights are uniform in +-1e-3, so greedy decoding emits the
same token over and over for every prompt, and a test that compares two outputs (a result with
its regeneration, a stream with the non-streamed answer, bf16 with fp32) could not tell them
apart. Weights with a standard deviation of ``WEIGHT_STD`` give each prompt its own output,
mostly ending on ``max_tokens`` and now and then on the eos token, as a real model would.

Usage: python make_model.py DIR
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB = 2048
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CORPUS_FILES = 200
WEIGHT_STD = 0.2
WEIGHT_SEED = 0

# ChatML. A final assistant message is left open (no <|im_end|>) when no generation prompt is
# asked for: that is what `continue_final_message` needs. The generation prompt opens a think
# block, so a reasoning parser that assumes reasoning until </think> (deepseek-r1) puts the
# output in reasoning_content.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if loop.last and m['role'] == 'assistant' and not add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if m.get('reasoning_content') -%}{{ '<think>' + m['reasoning_content'] }}"
    "{%- if m['content'] -%}{{ '</think>' }}{%- endif -%}{%- endif -%}"
    "{{ m['content'] }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>' }}{%- endif -%}"
)


def corpus() -> list[str]:
    """Python's standard library sources, in a fixed order (the same tokenizer every time)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))[:CORPUS_FILES]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def write_model(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "model_max_length": 8192,
                "chat_template": CHAT_TEMPLATE,
                "added_tokens_decoder": {
                    str(tok.token_to_id(t)): {"content": t, "special": True} for t in SPECIAL
                },
            },
            indent=2,
        )
    )
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": tok.get_vocab_size(),
                "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0,
                "hidden_act": "silu",
                "tie_word_embeddings": True,
                "torch_dtype": "bfloat16",
                "bos_token_id": tok.token_to_id("<|endoftext|>"),
                "eos_token_id": eos,
                "use_sliding_window": False,
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2))
    write_weights(out)


def write_weights(out: Path) -> None:
    """``model.safetensors``: the config's network with normal(0, WEIGHT_STD) weights, seeded."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config.from_pretrained(out)
    config.initializer_range = WEIGHT_STD
    torch.manual_seed(WEIGHT_SEED)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    # Tied embeddings: SGLang reads model.embed_tokens.weight and skips lm_head.weight, so the
    # shared tensor is saved under the embedding's name only.
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    write_model(Path(sys.argv[1]))
