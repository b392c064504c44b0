#!/usr/bin/env python3
"""bm in bfloat16 on the CPU against HF's own bfloat16 forward and generate(): the bf16 oracle's figures.

    python benchmarks/bf16_oracle.py [--prompts 16] [--max-new 24] [--models tiny,smollm2-135m]

For each model (the tiny random one, and SmolLM2-135M where its preset is installed here): the largest
absolute difference between bm's logits and HF's for every position of the prompts (bm computing each
prompt in two chunks, the second after a cached prefix, as the engine does), the share of positions
whose argmax agrees, and, for greedy generation through the engine with all prompts batched together,
the tokens that agree with HF generate() (run on each prompt alone) before the first divergence, and
the requests that agree in full; and, as the scale to read the bf16 difference against, how far HF's
own bf16 logits are from its float32 ones. The same figures for float32 are printed beside them: there
bm's output must equal HF's exactly in tokens. Prints JSON; tests/test_bf16_oracle.py pins the tolerance.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch

from bm.batch_manager import BatchManager, InferenceRequest
from bm.batch_manager.offline import OfflineClient
from bm.config import config_from_dict
from bm.runtime import ModelRunner, load_model, work_item
from bm.runtime.model_loader import ModelConfig
from bm.runtime.presets import is_available


def reference(loaded) -> torch.nn.Module:
    ref = copy.deepcopy(loaded.model)
    ref.set_attn_implementation("sdpa")
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    return ref


def prompts(vocab: int, count: int, max_new: int) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        n = int(torch.randint(8, 96, (1,), generator=g))
        out.append((torch.randint(3, vocab, (n,), generator=g).tolist(), max_new))
    return out


def hf_rounding(ref, wide, specs) -> tuple[float, float]:
    """Max |HF in bf16 - HF in fp32| over the same positions, and the share of positions whose argmax
    agrees: the scale of bf16's own rounding, which bm's difference from HF's bf16 is to be read against."""
    worst, agree, total = 0.0, 0, 0
    for prompt, _ in specs:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            narrow, exact = ref(ids).logits[0].float(), wide(ids).logits[0]
        worst = max(worst, (narrow - exact).abs().max().item())
        agree += int((narrow.argmax(-1) == exact.argmax(-1)).sum())
        total += len(prompt)
    return worst, agree / total


def logit_figures(loaded, ref, specs) -> tuple[float, float]:
    """Max |bm - HF| over every prompt position, and the share of positions whose argmax agrees."""
    bs = 16
    worst, agree, total = 0.0, 0, 0
    for prompt, _ in specs:
        blocks = -(-len(prompt) // bs) + 1
        runner = ModelRunner(loaded, blocks, bs, blocks * bs)
        table, cut = list(range(blocks)), len(prompt) // 2
        first = runner.forward([work_item(prompt[:cut], 0, table, True, keep_all=True)])
        second = runner.forward([work_item(prompt[cut:], cut, table, True, keep_all=True)])
        ours = torch.cat([first, second])
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0].float()
        worst = max(worst, (ours - theirs).abs().max().item())
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += len(prompt)
    return worst, agree / total


def token_figures(loaded, ref, specs, dtype: str) -> dict:
    requests = [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)]
    client = OfflineClient(requests)
    config = config_from_dict({"model": {"device": "cpu", "dtype": dtype}, "kv_cache": {"max_tokens": 8192}})
    with BatchManager(config, client.get_requests, client.send_response, model=loaded):
        client.wait()
    matched = total = whole = 0
    for i, (prompt, max_new) in enumerate(specs):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=max_new, do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
        theirs, ours = out[0, len(prompt) :].tolist(), client.results[i].output_ids
        prefix = next((j for j, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), len(theirs))
        matched, total, whole = matched + prefix, total + len(theirs), whole + (prefix == len(theirs))
    return {"tokens_before_first_divergence": f"{matched}/{total}", "token_agreement": round(matched / total, 4),
            "requests_identical": f"{whole}/{len(specs)}"}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new", type=int, default=24)
    p.add_argument("--models", default="tiny,smollm2-135m")
    args = p.parse_args()
    result: dict = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(), "models": {}}
    for name in args.models.split(","):
        if name != "tiny" and not is_available(name):
            result["models"][name] = "not installed here"
            continue
        line = {}
        for dtype in ("bfloat16", "float32"):
            cfg = ModelConfig(device="cpu", dtype=dtype, seed=0, preset=None if name == "tiny" else name)
            loaded = load_model(cfg)
            ref = reference(loaded)
            specs = prompts(loaded.vocab_size, args.prompts, args.max_new)
            worst, argmax = logit_figures(loaded, ref, specs)
            line[dtype] = {"max_abs_logit_diff": round(worst, 5), "position_argmax_agreement": round(argmax, 4),
                           **token_figures(loaded, ref, specs, dtype)}  # fmt: skip
            if dtype == "bfloat16":  # both bf16 forwards against HF's in float32, the more exact answer
                wide = copy.deepcopy(ref).float()
                hf_worst, hf_argmax = hf_rounding(ref, wide, specs)
                bm_worst, bm_argmax = logit_figures(loaded, wide, specs)
                line[dtype] |= {
                    "hf_bf16_vs_hf_fp32_max_abs_logit_diff": round(hf_worst, 5),
                    "hf_bf16_vs_hf_fp32_argmax_agreement": round(hf_argmax, 4),
                    "bm_bf16_vs_hf_fp32_max_abs_logit_diff": round(bm_worst, 5),
                    "bm_bf16_vs_hf_fp32_argmax_agreement": round(bm_argmax, 4),
                }
            print(name, dtype, line[dtype], file=sys.stderr, flush=True)
        result["models"][name] = line
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
