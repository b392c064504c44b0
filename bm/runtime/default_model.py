"""The embedded default model: a tiny Llama-architecture config with seeded random weights.

It exists so ``bm run`` works on a fresh machine with no download. The same config ships as
``configs/models/tiny-llama.json`` for users who want to copy and change it; a test keeps the two equal.
"""

from __future__ import annotations

from bm.runtime.tokenizer import ByteTokenizer

TINY_LLAMA_CONFIG: dict = {
    "model_type": "llama",
    "vocab_size": ByteTokenizer.vocab_size,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "initializer_range": 0.2,
    "pad_token_id": ByteTokenizer.pad_token_id,
    "bos_token_id": ByteTokenizer.bos_token_id,
    "eos_token_id": ByteTokenizer.eos_token_id,
    "tie_word_embeddings": False,
}
