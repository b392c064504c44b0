#!/usr/bin/env python3
"""Mixed beam widths in one step (bm) against TensorRT-LLM's one-beam-width-per-step rule, model-free.

    python benchmarks/mixed_beam_widths.py [--requests 32] [--beam-width 4]

TensorRT-LLM's micro-batch scheduler skips a generation request whose beam width differs from the first
scheduled one (its decoder runs one width per step; see ``BeamWidthMismatchSkipped`` in
tests/conformance). bm's runtime packs every request's beams into one forward, so it does not skip; the
conformance case is a deliberate difference and this is its benchmark. Both runs drive bm's real engine
loop over the fake executor (no model): the rule is plugged in as a custom micro-batch scheduler. Every
other request asks for ``--beam-width`` beams, the rest for one, all submitted at t=0. Prints JSON:
iterations to drain and tokens computed per iteration under each rule. Iterations, not seconds: the
forward's cost per token is the same under both rules, so fewer, fuller iterations is the gain.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence

from bm.config import config_from_dict
from bm.engine.execution.fake_executor import FakeExecutor
from bm.engine.requests.request import Request
from bm.engine.step.core import EngineCore
from bm.scheduling import LlmRequest, MicroBatchScheduler


class OneBeamWidthPerStep(MicroBatchScheduler):
    """TensorRT-LLM's rule: generation requests whose beam width differs from the first are skipped."""

    def schedule(
        self,
        fitting_requests: Sequence[LlmRequest],
        inflight_request_ids: frozenset[int] = frozenset(),
        computed: Mapping[int, int] | None = None,
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        width = next((r.beam_width for r in fitting_requests if r.is_generation_phase), None)
        kept = [r for r in fitting_requests if not r.is_generation_phase or r.beam_width == width]
        return super().schedule(kept, inflight_request_ids, computed)


def drain(args: argparse.Namespace, micro_batch_scheduler: str | None) -> dict:
    engine = {
        "max_batch_size": args.max_batch_size,
        "max_num_tokens": args.max_num_tokens,
        "max_beam_width": args.beam_width,
        "max_num_active_requests": args.requests,
    }
    if micro_batch_scheduler:
        engine["micro_batch_scheduler"] = micro_batch_scheduler
    config = config_from_dict(
        {"engine": engine, "kv_cache": {"tokens_per_block": 16, "max_tokens": 16 * 8192}}
    )
    core = EngineCore(config, FakeExecutor(vocab_size=1000))
    for rid in range(args.requests):
        beams = args.beam_width if rid % 2 else 1
        prompt = [(rid * 7 + i) % 997 + 3 for i in range(args.prompt_len)]
        refused = core.add_request(
            Request(request_id=rid, input_ids=prompt, request_output_len=args.output_len, beam_width=beams)
        )
        if refused is not None:
            raise SystemExit(f"request {rid} refused: {refused.error}")
    iterations = computed = 0
    while core.num_active:
        computed += core.step().computed_tokens
        iterations += 1
    return {"iterations": iterations, "tokens_per_iteration": round(computed / iterations, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-num-tokens", type=int, default=1024)
    args = p.parse_args()
    bm_run = drain(args, None)
    # imported by name, as a user's scheduler is (this folder is on sys.path when run as a script)
    trt_rule = drain(args, "mixed_beam_widths:OneBeamWidthPerStep")
    print(
        json.dumps(
            {
                "workload": vars(args),
                "bm_mixed_widths": bm_run,
                "one_width_per_step": trt_rule,
                "iterations_ratio": round(trt_rule["iterations"] / bm_run["iterations"], 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
