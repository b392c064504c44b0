#!/usr/bin/env python3
"""What quantizing on load costs in accuracy on a real model: perplexity and greedy agreement.

    python benchmarks/weight_quant_accuracy.py [--prompts datasets/chat.jsonl] [--max-tokens 64]
        [--schemes int8,fp8]

The model is the ``smollm2-135m`` preset (SmolLM2-135M-Instruct's real weights as its GGUF file holds
them), loaded in float32 (``model.quantization: none``, the file's exact expansion), then once per
``--schemes`` entry with its decoder's linears quantized on load from those weights: ``int8``
(bm.runtime.weight_quant, bm's int8 GEMM) and ``fp8`` (e4m3 rows, bm.runtime.group_linears, the group
GEMM), each running its kernel as in a bm run. Each chat prompt of ``--prompts`` is answered greedily
by the float32 model; then every prompt and its answer are scored teacher-forced by each. Over the
answers' tokens: perplexity of each, its ratio to float32's, and the share of positions whose argmax
token is float32's. Prints JSON.
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
    p.add_argument("--schemes", default="int8,fp8", help="quantized on load: int8, fp8")
    args = p.parse_args()
    full = load_model(ModelConfig(preset="smollm2-135m", device="cpu", quantization="none"))
    tokenizer = full.tokenizer.tokenizer
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    sequences = []
    report: dict = {"model": "smollm2-135m", "prompts": str(args.prompts)}
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
        report |= {"answer_tokens": count, "perplexity_float32": round(full_ppl, 4)}
        for scheme in args.schemes.split(","):
            quantized = load_model(ModelConfig(preset="smollm2-135m", device="cpu", quantization=scheme))
            quantized.model.set_attn_implementation("sdpa")
            ppl, argmax, _ = score(quantized.model, sequences)
            report[scheme] = {
                "quantized_linears": quantized.num_quantized_linears,
                "perplexity": round(ppl, 4),
                "perplexity_ratio": round(ppl / full_ppl, 4),
                "greedy_agreement": round((argmax == full_argmax).float().mean().item(), 4),
            }
            del quantized
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
