"""The engine's final responses as the outputs ``bm.LLM`` returns, in vLLM's shapes.

Why apart from :mod:`bm.llm`: turning a core response into text, stop-string cuts, log probs with their
ranks, beams and timings is the whole of what a vLLM user reads back, and it needs only the tokenizer;
the front door keeps to building requests and running them.
"""

from __future__ import annotations

import time
from typing import Any

from bm.engine.outputs.sequences import FinishedSequence, finished_sequences
from bm.engine.requests.request import Response
from bm.llm_params import CompletionOutput, InvalidParameterError, Logprob, RequestOutput, SamplingParams
from bm.llm_types import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, RequestMetrics


class OutputBuilder:
    """Core responses -> ``RequestOutput`` / ``BeamSearchOutput`` for one model's tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def request_output(
        self,
        request_id: int,
        prompt: str | None,
        ids: list[int],
        params: SamplingParams,
        result: Response,
        finished_at: float | None = None,
        lora_request: Any = None,
    ) -> RequestOutput:
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = self.prompt_logprobs(ids, result.context_logits, params.prompt_logprobs)
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        decode = (
            None if self.tokenizer is None else lambda tokens: self._text(tokens, params.skip_special_tokens)
        )
        sequences = finished_sequences(result, stops, decode, params.include_stop_str_in_output)
        error = (result.error or None) if result.samples is None else None
        completions = [self.completion(s, params, error) for s in sequences]
        return RequestOutput(
            str(request_id),
            prompt,
            ids,
            completions,
            prompt_logprobs=prompt_logprobs,
            metrics=metrics(result, finished_at),
            lora_request=lora_request,
        )

    def beam_output(
        self,
        ids: list[int],
        params: BeamSearchParams,
        result: Response,
        end_id: int | None,
        lora_request: Any = None,
    ) -> BeamSearchOutput:
        """Every beam, best first as the engine ranks them; ``tokens``/``text`` include the prompt, as
        vLLM's beams do. A beam that ends on the end token ends with it, as vLLM's do."""
        beams = result.beams or [list(result.output_ids)]
        log_probs = result.beam_log_probs or [[] for _ in beams]
        cums = result.cum_log_probs or [sum(lp) for lp in log_probs]
        ranks = result.beam_log_prob_ranks or [[None] * len(b) for b in beams]
        out = BeamSearchOutput()
        for beam, lps, cum, beam_ranks in zip(beams, log_probs, cums, ranks, strict=True):
            tokens = [*ids, *beam]
            chosen = [
                {t: Logprob(lp, rank, self._piece(t))}
                for t, lp, rank in zip(beam, lps, beam_ranks, strict=False)
            ]
            reason = "stop" if end_id is not None and beam and beam[-1] == end_id else "length"
            text = self._text(tokens, params.skip_special_tokens) if self.tokenizer is not None else None
            out.sequences.append(BeamSearchSequence(tokens, chosen, lora_request, float(cum), text, reason))
        return out

    def prompt_logprobs(self, ids: list[int], logits: Any, k: int) -> list[dict[int, Logprob] | None]:
        """vLLM's ``prompt_logprobs`` from the engine's context logits (the model's raw logits at every
        prompt position, ``[prompt, vocab]``): position i's give token i+1 its log probability and its
        rank among the whole vocabulary (1: the most likely), beside the ``k`` most likely tokens there.
        The first token gets None: nothing before it predicts it."""
        rows = 0 if logits is None else int(logits.shape[0])
        if rows != len(ids):
            raise RuntimeError(
                f"prompt_logprobs: the engine returned the logits of {rows} prompt positions for a prompt "
                f"of {len(ids)} tokens"
            )
        out: list[dict[int, Logprob] | None] = [None]
        if len(ids) < 2:
            return out
        logprobs = logits[:-1].float().log_softmax(-1)
        chosen = logprobs.gather(1, logprobs.new_tensor(ids[1:]).long().unsqueeze(1))
        ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
        values = chosen.squeeze(1).tolist()
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        tops = list(zip(top_ids.tolist(), top_values.tolist(), strict=True)) if k else []
        for i, token in enumerate(ids[1:]):
            position = {token: Logprob(values[i], ranks[i], self._piece(token))}
            for rank, (tok, lp) in enumerate(zip(*tops[i], strict=True) if k else (), 1):
                position.setdefault(tok, Logprob(lp, rank, self._piece(tok)))
            out.append(position)
        return out

    def completion(
        self, sequence: FinishedSequence, params: SamplingParams, error: str | None = None
    ) -> CompletionOutput:
        """One sequence (the response, or one of its n samples) as vLLM's CompletionOutput."""
        tokens, text = sequence.token_ids, sequence.text or ""
        reason, stop_reason, chosen = sequence.finish_reason, sequence.stop_reason, sequence.log_probs
        if params.logprobs is None or chosen is None:
            return CompletionOutput(
                sequence.index, text, tokens, reason, error=error, stop_reason=stop_reason
            )
        tops = sequence.top_log_probs or [[] for _ in tokens]
        logprobs = [
            self._position(token, lp, getattr(top, "rank", None), top, params.logprobs)
            for token, lp, top in zip(tokens, chosen, tops, strict=False)
        ]
        return CompletionOutput(
            sequence.index, text, tokens, reason, logprobs, float(sum(chosen)), error, stop_reason
        )

    def _text(self, tokens: list[int], skip_special_tokens: bool) -> str:
        """The text of ``tokens``: special tokens skipped (bm's tokenizers do), or written as the
        checkpoint's tokenizer spells them with ``skip_special_tokens=False`` (for SamplingParams
        checked when the request was built: only a checkpoint's tokenizer can)."""
        if skip_special_tokens:
            return self.tokenizer.decode(tokens)
        hf = getattr(self.tokenizer, "tokenizer", None)
        if hf is None:
            raise InvalidParameterError(
                "skip_special_tokens: False writes special tokens as the tokenizer spells them, and this "
                "model's tokenizer (bm's byte tokenizer) has no text for them; read them from token_ids"
            )
        return hf.decode(tokens, skip_special_tokens=False)

    def _piece(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def _position(
        self, token: int, logprob: float, rank: int | None, top: list[tuple[int, float]], k: int
    ) -> dict[int, Logprob]:
        """One position's log probs in vLLM's shape: the chosen token first, with its rank among the whole
        vocabulary (counted by the runtime beside the top ones: ``TopLogProbs.rank``), then the ``k`` most
        likely."""
        if rank is None:  # a position without a count (a draft token accepted): known when among the top
            rank = {int(t): r for r, (t, _lp) in enumerate(top, 1)}.get(token)
        out = {token: Logprob(logprob, rank, self._piece(token))}
        for r, (tok, lp) in enumerate(top[:k], 1):
            out.setdefault(int(tok), Logprob(lp, r, self._piece(int(tok))))
        return out


def metrics(result: Response, finished_at: float | None) -> RequestMetrics:
    """The engine's timings (``time.perf_counter``'s clock) on ``time.time()``'s, as vLLM reports them."""
    shift = time.time() - time.perf_counter()

    def wall(t: float | None) -> float | None:
        return None if t is None else t + shift

    arrival = wall(result.arrival_time) or 0.0
    finished = wall(finished_at)
    scheduled = wall(result.first_scheduled_time)
    return RequestMetrics(
        arrival_time=arrival,
        last_token_time=finished if finished is not None else arrival,
        first_scheduled_time=scheduled,
        first_token_time=wall(result.first_token_time),
        time_in_queue=None if scheduled is None else scheduled - arrival,
        finished_time=finished,
    )
