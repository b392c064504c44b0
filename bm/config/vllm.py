"""vLLM's engine argument names and the bm config key each one sets: one table for ``bm.LLM``'s keywords
(``max_model_len=512``) and the CLI's flags (``--max-model-len 512``), so the two cannot drift; and one
table of the vLLM names bm has no knob for, with the bm way to get what each asks, for both doors.

``gpu_memory_utilization`` is approximate: bm's ``kv_cache.free_memory_fraction`` is a share of the memory
free after the weights load (TensorRT-LLM's meaning), not of the whole device as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    "kv_cache_dtype": "kv_cache.dtype",  # auto, fp8 and fp8_e4m3 as vLLM reads them; bm's int8 too
    # vLLM's names a checkpoint's format (awq, gptq, fp8, ...) or an on-load scheme; bm has int8 on load
    # (and None, vLLM's default): any other is refused naming the choices
    "quantization": "model.quantization",
}
# The booleans among them: on the command line a switch (--enable-prefix-caching / --no-enable-prefix-caching).
VLLM_SWITCHES: tuple[str, ...] = ("enable_prefix_caching", "enable_chunked_prefill")
# vLLM's enforce_eager: no CUDA graphs (bm's model.cuda_graphs "off"; False leaves it at "auto").
ENFORCE_EAGER_KEY = "model.cuda_graphs"


@dataclass(frozen=True)
class NotInBm:
    """A vLLM name bm has no counterpart for: why, what to do instead at each door, and the values that
    ask for what bm does anyway.

    Those values are accepted (nothing to set), so a vLLM script that spells out a default, such as
    ``trust_remote_code=False``, runs unchanged; any other value is refused with ``why`` and the fix."""

    why: str
    keyword: str  # the fix in bm.LLM(...) / SamplingParams(...)
    flag: str = ""  # the fix on the command line (engine arguments)
    inert: tuple[Any, ...] = ()

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` asks for what bm does anyway (``False`` is not ``0`` here)."""
        return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in self.inert)


_LOCAL = "bm reads local checkpoints only (no hub downloads)"
# vLLM engine arguments (LLM(...) keywords, and the flags they are spelled as) bm has no knob for.
VLLM_UNSUPPORTED: dict[str, NotInBm] = {
    "trust_remote_code": NotInBm(
        "bm builds models from transformers' own classes and runs no code from a checkpoint",
        "drop it",
        "drop the flag",
        (False,),
    ),
    "pipeline_parallel_size": NotInBm(
        "bm has no pipeline parallelism",
        "split a model over ranks with tensor parallelism: bm run --tensor-parallel N (docs/parallel.md)",
        "use --tensor-parallel (ranks per replica) or --data-parallel (replicas)",
        (1,),
    ),
    "swap_space": NotInBm(
        "bm never swaps KV blocks to host memory",
        "with engine={'scheduler_policy': 'max_utilization'} a request short of blocks is paused and "
        "recomputed",
        "with --set engine.scheduler_policy=max_utilization a request short of blocks is paused and "
        "recomputed",
        (0,),
    ),
    "cpu_offload_gb": NotInBm(
        "bm keeps every weight on the device",
        "size the KV cache with gpu_memory_utilization= (kv_cache.free_memory_fraction) or "
        "kv_cache={'max_tokens': N}",
        "size the KV cache with --gpu-memory-utilization (kv_cache.free_memory_fraction) or "
        "--set kv_cache.max_tokens=N",
        (0,),
    ),
    "download_dir": NotInBm(_LOCAL, "give model=DIR", "give --model DIR", (None,)),
    "revision": NotInBm(_LOCAL, "give model=DIR", "give --model DIR", (None,)),
    "tokenizer_revision": NotInBm(_LOCAL, "give tokenizer=DIR", "give --tokenizer DIR", (None,)),
    "load_format": NotInBm(
        "bm reads safetensors checkpoints from a local directory",
        "give model=DIR",
        "give --model DIR",
        ("auto", "safetensors"),
    ),
    "tokenizer_mode": NotInBm(
        "bm loads a checkpoint's tokenizer through transformers, as its files say",
        "drop it",
        "drop the flag",
        ("auto",),
    ),
    "skip_tokenizer_init": NotInBm(
        "bm loads the tokenizer with the model",
        "drop it; prompts given as lists of token ids are not tokenized, and outputs keep token_ids "
        "beside the text",
        "drop the flag; lines with input_ids are not tokenized",
        (False,),
    ),
    "scheduling_policy": NotInBm(
        "bm admits requests first come, first served; its scheduler policy is engine.scheduler_policy "
        "(guaranteed_no_evict, max_utilization, static_batch)",
        "engine={'scheduler_policy': NAME}",
        "--set engine.scheduler_policy=NAME",
        ("fcfs",),
    ),
    "speculative_config": NotInBm(
        "bm's speculative decoding is engine.speculative",
        "engine={'speculative': {'method': 'ngram', 'num_draft_tokens': 4}}",
        "--set 'engine.speculative={method: ngram, num_draft_tokens: 4}'",
        (None,),
    ),
}
