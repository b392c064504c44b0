#!/usr/bin/env python3
"""What ``kv_cache.dtype: int8`` and ``fp8_e4m3`` cost in accuracy on a real model: perplexity and
greedy agreement.

    python benchmarks/kv_quant_accuracy.py [--prompts datasets/chat.jsonl] [--max-tokens 64]

The model is the ``smollm2-135m`` preset (SmolLM2-135M-Instruct's real weights; its checkpoint carries
no KV scales, so fp8 runs at 1.0, as vLLM does then). Each chat prompt of ``--prompts`` is answered
greedily with the full-width cache; then every prompt and its answer are scored teacher-forced, with
keys and values as a float32 cache holds them and as each quantized cache gives them back
(bm.runtime.kv_quant.round_trip, the rounding bm's caches apply: tests/test_kv_quant.py holds bm's
engine equal to HF with it). Over the answers' tokens: perplexity with each cache, its ratio to the
float32 cache's, and the share of positions whose argmax token is the same. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bm.config.model import ModelConfig
from bm.runtime.kv_quant import round_trip
from bm.runtime.model_loader import load_model

ROOT = Path(__file__).resolve().parents[1]
QUANTIZED = ("int8", "fp8_e4m3")
_CACHE = {"dtype": "auto"}


def _attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA, over keys and values as the cache switched on gives them back."""
    if _CACHE["dtype"] != "auto":
        key, value = round_trip(key, _CACHE["dtype"]), round_trip(value, _CACHE["dtype"])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def score(model, sequences: list[tuple[int, torch.Tensor]]) -> tuple[float, torch.Tensor, int]:
    """Perplexity over each sequence's answer tokens, the argmax at each of them, and their count."""
    nll, count, argmax = 0.0, 0, []
    for prompt_len, ids in sequences:
        logits = model(ids[None]).logits[0, :-1].float()
        answer = slice(prompt_len - 1, None)
        targets = ids[1:][answer]
        nll -= logits[answer].log_softmax(-1).gather(1, targets[:, None]).sum().item()
        count += targets.numel()
        argmax.append(logits[answer].argmax(-1))
    return math.exp(nll / count), torch.cat(argmax), count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=Path, default=ROOT / "datasets" / "chat.jsonl")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    AttentionInterface.register("bm_quantized_kv_probe", _attention)
    loaded = load_model(ModelConfig(preset="smollm2-135m", device="cpu"))
    model, tokenizer = loaded.model, loaded.tokenizer.tokenizer
    model.set_attn_implementation("bm_quantized_kv_probe")
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    sequences = []
    with torch.inference_mode():
        for row in rows:
            ids = tokenizer.apply_chat_template(
                row["messages"], add_generation_prompt=True, return_tensors="pt"
            )
            ids = ids if torch.is_tensor(ids) else ids["input_ids"]
            out = model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
            sequences.append((ids.shape[1], out[0]))
        full_ppl, full_argmax, count = score(model, sequences)
        report = {
            "model": "smollm2-135m",
            "prompts": str(args.prompts),
            "answer_tokens": count,
            "perplexity_float32_cache": round(full_ppl, 4),
        }
        for dtype in QUANTIZED:
            _CACHE["dtype"] = dtype
            ppl, argmax, _ = score(model, sequences)
            report[dtype] = {
                "perplexity": round(ppl, 4),
                "perplexity_ratio": round(ppl / full_ppl, 4),
                "greedy_agreement": round((argmax == full_argmax).float().mean().item(), 4),
            }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
