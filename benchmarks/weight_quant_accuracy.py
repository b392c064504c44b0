#!/usr/bin/env python3
"""What ``model.quantization: int8`` costs in accuracy on a real model: perplexity and greedy agreement.

    python benchmarks/weight_quant_accuracy.py [--prompts datasets/chat.jsonl] [--max-tokens 64]

The model is the ``smollm2-135m`` preset (SmolLM2-135M-Instruct's real weights), loaded twice: in
float32, and with its decoder's linears quantized to int8 on load (bm.runtime.weight_quant; each runs
bm's int8 GEMM, as in a bm run). Each chat prompt of ``--prompts`` is answered greedily by the float32
model; then every prompt and its answer are scored teacher-forced by both. Over the answers' tokens:
perplexity of each, the int8 / float32 ratio, and the share of positions whose argmax token is the same.
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from kv_quant_accuracy import score

from bm.config.model import ModelConfig
from bm.runtime.model_loader import load_model

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=Path, default=ROOT / "datasets" / "chat.jsonl")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    full = load_model(ModelConfig(preset="smollm2-135m", device="cpu"))
    tokenizer = full.tokenizer.tokenizer
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    sequences = []
    with torch.inference_mode():
        full.model.set_attn_implementation("sdpa")
        for row in rows:
            ids = tokenizer.apply_chat_template(
                row["messages"], add_generation_prompt=True, return_tensors="pt"
            )
            ids = ids if torch.is_tensor(ids) else ids["input_ids"]
            out = full.model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
            sequences.append((ids.shape[1], out[0]))
        full_ppl, full_argmax, count = score(full.model, sequences)
        del full
        int8 = load_model(ModelConfig(preset="smollm2-135m", device="cpu", quantization="int8"))
        int8.model.set_attn_implementation("sdpa")
        ppl, argmax, _ = score(int8.model, sequences)
    print(
        json.dumps(
            {
                "model": "smollm2-135m",
                "prompts": str(args.prompts),
                "answer_tokens": count,
                "quantized_linears": int8.num_quantized_linears,
                "perplexity_float32": round(full_ppl, 4),
                "int8": {
                    "perplexity": round(ppl, 4),
                    "perplexity_ratio": round(ppl / full_ppl, 4),
                    "greedy_agreement": round((argmax == full_argmax).float().mean().item(), 4),
                },
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
