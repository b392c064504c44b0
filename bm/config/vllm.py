"""vLLM's engine argument names and the bm config key each one sets: one table for ``bm.LLM``'s keywords
(``max_model_len=512``) and the CLI's flags (``--max-model-len 512``), so the two cannot drift.

``gpu_memory_utilization`` is approximate: bm's ``kv_cache.free_memory_fraction`` is a share of the memory
free after the weights load (TensorRT-LLM's meaning), not of the whole device as in vLLM.
"""

from __future__ import annotations

VLLM_ENGINE_KEYS: dict[str, str] = {
    "max_model_len": "engine.max_seq_len",
    "gpu_memory_utilization": "kv_cache.free_memory_fraction",
    "dtype": "model.dtype",
    "max_num_seqs": "engine.max_batch_size",
    "max_num_batched_tokens": "engine.max_num_tokens",
    "enable_prefix_caching": "kv_cache.enable_block_reuse",
    "enable_chunked_prefill": "engine.enable_chunked_context",
    "tokenizer": "model.tokenizer",
    "block_size": "kv_cache.tokens_per_block",
}
# The booleans among them: on the command line a switch (--enable-prefix-caching / --no-enable-prefix-caching).
VLLM_SWITCHES: tuple[str, ...] = ("enable_prefix_caching", "enable_chunked_prefill")
# vLLM's enforce_eager: no CUDA graphs (bm's model.cuda_graphs "off"; False leaves it at "auto").
ENFORCE_EAGER_KEY = "model.cuda_graphs"
