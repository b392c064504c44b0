"""From a forward's logits to each request's next token(s): controls, sampling, log probs, beam steps.

A batch where no request asked for anything beyond temperature / top-k / top-p goes straight to the
sampler (:meth:`Decoder.decode_on_device`, its tokens left on the device). Otherwise the controls of :mod:`bm.runtime.logits`
run over the batch, beam requests take a beam-search step on their rows (HF applies its processors to
log-probabilities in beam search, so bm does too), and log probs are read off the processed
distribution (``log_softmax(logits / temperature)`` before top-k/top-p; temperature 1 for greedy rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from bm.runtime.beam_search import StepOutcome
from bm.runtime.grammar import GrammarRuntime, MaskApplier
from bm.runtime.logits import DecodingState, LogitsRow, apply_controls
from bm.runtime.sampler import Sampler
from bm.scheduling.request import LlmRequest


@dataclass
class DecodeResult:
    tokens: list[int]  # one per row (beam rows: unused)
    log_probs: list[float | None] | None = None  # one per row when some row asked for them
    beams: dict[int, StepOutcome] = field(default_factory=dict)  # request id -> its beam step
    faults: dict[int, str] = field(default_factory=dict)  # request id -> why its decoding failed
    # one per row when some row asked for top log probs: (token, log prob) pairs, most likely first
    top_log_probs: list[list[tuple[int, float]] | None] | None = None


class Decoder:
    def __init__(self, grammar: GrammarRuntime | None = None) -> None:
        self.sampler = Sampler()
        self.grammar = grammar
        self.masks = MaskApplier()

    def release(self, request_id: int) -> None:
        self.sampler.release(request_id)

    @torch.inference_mode()
    def decode_on_device(self, logits: torch.Tensor, requests: Sequence[LlmRequest]) -> torch.Tensor | None:
        """The tokens of rows that ask for nothing but the sampler, left on the logits' device (the
        overlap scheduler reads them a step later); None when any row needs :meth:`decode`'s host work."""
        if any(r.decoding is not None for r in requests):
            return None
        return self.sampler.sample_on_device(
            logits, [r.sampling for r in requests], [r.request_id for r in requests]
        )

    @torch.inference_mode()
    def decode(
        self, logits: torch.Tensor, requests: Sequence[LlmRequest], beams: Sequence[int]
    ) -> DecodeResult:
        """``logits [rows, vocab]``; row ``i`` belongs to ``requests[i]`` (beam ``beams[i]``). A batch
        where no row asks for more than the sampler goes to :meth:`decode_on_device` instead."""
        params = [r.sampling for r in requests]
        ids = [r.request_id for r in requests]

        rows: list[LogitsRow | None] = []
        beam_rows: dict[int, list[int]] = {}
        kept: list[tuple[int, DecodingState]] = []  # rows whose generation logits are returned
        for i, (req, b) in enumerate(zip(requests, beams, strict=True)):
            opts: DecodingState | None = req.decoding
            if opts is None:
                rows.append(None)
                continue
            if opts.controls.return_generation_logits and opts.beam is None:
                kept.append((i, opts))
            output = opts.beam.tokens[b] if opts.beam is not None else req.output_ids
            rows.append(LogitsRow(req.request_id, opts, req.prompt_ids, output, req.sampling.end_id))
            if opts.beam is not None:
                beam_rows.setdefault(req.request_id, []).append(i)
        _keep_generation_logits(logits, kept)
        if beam_rows:
            index = torch.tensor([i for rs in beam_rows.values() for i in rs], device=logits.device)
            logits.index_copy_(0, index, torch.log_softmax(logits.index_select(0, index), dim=-1))
        faults: dict[int, str] = {}
        logits = apply_controls(logits, rows, faults)
        self._mask_grammars(logits, rows, faults)
        tokens = self.sampler.sample(logits, params, ids)
        result = DecodeResult(tokens, faults=faults)
        host = _beam_rows_on_host(logits, beam_rows)
        for rid, indices in beam_rows.items():
            if rid in faults:
                continue
            opts = rows[indices[0]].state  # type: ignore[union-attr]
            result.beams[rid] = opts.beam.step(host(indices))  # type: ignore[union-attr]
        wanted = [
            i
            for i, r in enumerate(rows)
            if r is not None and r.state.controls.return_log_probs and r.state.beam is None
        ]
        if wanted:
            index = torch.tensor(wanted, device=logits.device)
            temperature = torch.tensor(
                [params[i].temperature if not params[i].is_greedy else 1.0 for i in wanted],
                device=logits.device,
            )
            chosen = torch.tensor([tokens[i] for i in wanted], device=logits.device)
            lp = torch.log_softmax(logits.index_select(0, index) / temperature[:, None], dim=-1)
            values = lp.gather(1, chosen[:, None])[:, 0].tolist()
            result.log_probs = [None] * len(rows)
            for i, v in zip(wanted, values, strict=True):
                result.log_probs[i] = v
            counts = [rows[i].state.controls.top_log_probs for i in wanted]  # type: ignore[union-attr]
            if any(counts):
                result.top_log_probs = [None] * len(rows)
                for i, top in zip(wanted, _top_log_probs(lp, counts), strict=True):
                    result.top_log_probs[i] = top
        return result

    def _mask_grammars(
        self, logits: torch.Tensor, rows: Sequence[LogitsRow | None], faults: dict[int, str]
    ) -> None:
        """Structured output, last of the logits controls: each guided row's matcher follows its
        request's accepted tokens, then one bitmask for all of them masks the batch's logits."""
        guided = [(i, r) for i, r in enumerate(rows) if r is not None and r.state.grammar is not None]
        if not guided or self.grammar is None:
            return
        live = []
        for i, r in guided:
            problem = r.state.grammar.sync(r.output)  # type: ignore[union-attr]
            if problem:
                faults[r.request_id] = problem
            elif r.request_id not in faults:
                live.append((i, r.state.grammar))
        if live:
            bitmask = self.grammar.fill([state for _, state in live])
            self.masks.apply(logits, [i for i, _ in live], bitmask)
            for (i, _), allows in zip(live, bitmask.ne(0).any(dim=1).tolist(), strict=True):
                if not allows:  # a dead end the compile did not see: end this request, not the batch
                    faults[rows[i].request_id] = "structured output: no token can continue the output"


def _top_log_probs(lp: torch.Tensor, counts: list[int]) -> list[list[tuple[int, float]] | None]:
    """Each row's ``counts[i]`` most likely (token, log prob) pairs, most likely first: one topk over the
    rows for the largest count, one copy to the host."""
    values, ids = lp.topk(max(counts), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [list(zip(ids[j][:k], values[j][:k], strict=True)) if k else None for j, k in enumerate(counts)]


def _keep_generation_logits(logits: torch.Tensor, kept: list[tuple[int, DecodingState]]) -> None:
    """Each kept row to the host, all in one copy (one per request would sync the device each time)."""
    if not kept:
        return
    index = torch.tensor([i for i, _ in kept], device=logits.device)
    rows = logits.index_select(0, index).to("cpu", copy=True)
    for row, (_, opts) in zip(rows, kept, strict=True):
        opts.generation_logits.append(row)


def _beam_rows_on_host(logits: torch.Tensor, beam_rows: dict[int, list[int]]):
    """``indices -> [rows, vocab]`` float32 on the host. On a device, every beam request's rows travel in
    one copy (beam steps run on the host); on CPU the rows are indexed as before, unchanged."""
    if logits.device.type == "cpu" or not beam_rows:
        return lambda indices: logits[indices]
    order = [i for rs in beam_rows.values() for i in rs]
    position = {row: j for j, row in enumerate(order)}
    host = logits[torch.tensor(order, device=logits.device)].float().cpu()
    return lambda indices: host[[position[i] for i in indices]]
