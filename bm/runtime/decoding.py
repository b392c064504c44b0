"""From a forward's logits to each request's next token(s): controls, sampling, log probs, beam steps.

A batch where no request asks for host work (controls that need the output's tokens on the host, a
grammar, beams, kept generation logits) is decoded on the device (:meth:`Decoder.decode_on_device`: the controls that
need only what the host knows at launch, then the sampler): its tokens, and the log probs some rows
asked for, stay on the device until the executor collects the step. Stop words and context logits need
no host work at this point. Otherwise the controls of :mod:`bm.runtime.logits`
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
from bm.runtime.logits import DecodingState, LogitsRow, PendingTokens, apply_controls
from bm.runtime.sampler import Sampler
from bm.runtime.transfer import to_device
from bm.scheduling.request import LlmRequest, Sampling, TopLogProbs


@dataclass
class DecodeResult:
    tokens: list[int]  # one per row (beam rows: unused)
    log_probs: list[float | None] | None = None  # one per row when some row asked for them
    beams: dict[int, StepOutcome] = field(default_factory=dict)  # request id -> its beam step
    faults: dict[int, str] = field(default_factory=dict)  # request id -> why its decoding failed
    # one per row when some row asked for top log probs: (token, log prob) pairs, most likely first
    top_log_probs: list[list[tuple[int, float]] | None] | None = None


@dataclass
class DeviceDecode:
    """A batch decoded on the device: its tokens and the log probs its rows asked for, read on the host
    only when the step is collected (one copy, behind the kernels), so an overlapped launch never waits
    for them. ``wanted``: the rows with log probs, ``top_counts`` their top-log-prob counts."""

    tokens: torch.Tensor  # [rows]
    wanted: list[int] = field(default_factory=list)
    log_probs: torch.Tensor | None = None  # [len(wanted)]
    top_counts: list[int] = field(default_factory=list)
    top_values: torch.Tensor | None = None  # [len(wanted), max(top_counts)]
    top_ids: torch.Tensor | None = None
    ranks: torch.Tensor | None = None  # [len(wanted)]: each chosen token's rank (with top_values)

    def tensors(self) -> list[torch.Tensor]:
        """What the host reads, in the order :meth:`read` takes it back."""
        extra = [self.log_probs, self.top_values, self.top_ids, self.ranks]
        return [self.tokens, *(t for t in extra if t is not None)]

    def read(
        self, host: list[torch.Tensor]
    ) -> tuple[list[int], list[float | None], list[list[tuple[int, float]] | None]]:
        """Per row: its token, its log prob (None where not asked), its top log probs (None likewise),
        from :meth:`tensors`' host copies."""
        tokens = host[0].tolist()
        log_probs: list[float | None] = [None] * len(tokens)
        tops: list[list[tuple[int, float]] | None] = [None] * len(tokens)
        if self.log_probs is not None:
            for i, value in zip(self.wanted, host[1].tolist(), strict=True):
                log_probs[i] = value
        if self.top_values is not None:
            values, ids, ranks = host[2].tolist(), host[3].tolist(), host[4].tolist()
            for j, (i, k) in enumerate(zip(self.wanted, self.top_counts, strict=True)):
                tops[i] = _top(ids[j][:k], values[j][:k], ranks[j]) if k else None
        return tokens, log_probs, tops


def on_device_only(state: DecodingState | None) -> bool:
    """Whether a row's decoding needs nothing the host must read before its token is known: no control
    that needs the output's tokens on the host (n-grams, multi-token bad words, a post-processor), no
    grammar, no beams, no kept generation logits. Log probs, top log probs, stop words, context logits
    and the other controls are fine, applied on the device by :func:`bm.runtime.logits.apply_controls`:
    an embedding or logit bias, single-token bad words, a minimum length (the output's length counts a
    pending token) and the penalties (which count a pending token on the device)."""
    if state is None:
        return True
    controls = state.controls
    return (
        state.beam is None
        and state.grammar is None
        and not controls.reads_output
        and not controls.return_generation_logits
    )


class Decoder:
    def __init__(self, grammar: GrammarRuntime | None = None) -> None:
        self.sampler = Sampler()
        self.grammar = grammar
        self.masks = MaskApplier()

    def release(self, request_id: int) -> None:
        self.sampler.release(request_id)

    @torch.inference_mode()
    def decode_on_device(
        self, logits: torch.Tensor, requests: Sequence[LlmRequest], pending: PendingTokens | None = None
    ) -> DeviceDecode | None:
        """The batch's tokens and asked-for log probs, left on the logits' device (the overlap scheduler
        reads them a step later); None when any row needs :meth:`decode`'s host work. ``logits`` may be
        in the model's dtype: the argmax is exact, and log probs are taken in float32 from the same rows
        in the same order as :meth:`decode` takes them, so the values are the same bits. ``pending``: the
        requests whose last output token is still on the device (the penalties count it there)."""
        rows = []  # one pass: whether every row decodes here, and the controls of those that have some
        for r in requests:
            if not on_device_only(r.decoding):
                return None
            rows.append(_controlled_row(r))
        params = [r.sampling for r in requests]
        if any(rows):  # as decode() does: the controls on a float32 copy, everything after from it
            logits = apply_controls(logits.float(), rows, pending=pending)
        tokens = self.sampler.sample_on_device(logits, params, [r.request_id for r in requests])
        wanted = [
            i
            for i, r in enumerate(requests)
            if r.decoding is not None and r.decoding.controls.return_log_probs
        ]
        if not wanted:
            return DeviceDecode(tokens)
        lp, index = _log_softmax_rows(logits, params, wanted)
        chosen = tokens.index_select(0, index)
        out = DeviceDecode(tokens, wanted, lp.gather(1, chosen[:, None])[:, 0])
        out.top_counts = [requests[i].decoding.controls.top_log_probs for i in wanted]  # type: ignore[union-attr]
        if any(out.top_counts):
            out.top_values, out.top_ids = lp.topk(max(out.top_counts), dim=-1)
            out.ranks = _ranks(lp, out.log_probs)  # type: ignore[arg-type]
        return out

    @torch.inference_mode()
    def decode(
        self,
        logits: torch.Tensor,
        requests: Sequence[LlmRequest],
        beams: Sequence[int],
        pending: PendingTokens | None = None,
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
            if opts.beam is not None:
                rows.append(
                    LogitsRow(req.request_id, opts, req.prompt_ids, opts.beam.tokens[b], req.sampling.end_id)
                )
            else:
                rows.append(_logits_row(req, opts))
            if opts.beam is not None:
                beam_rows.setdefault(req.request_id, []).append(i)
        _keep_generation_logits(logits, kept)
        if beam_rows:
            index = torch.tensor([i for rs in beam_rows.values() for i in rs], device=logits.device)
            logits.index_copy_(0, index, torch.log_softmax(logits.index_select(0, index), dim=-1))
        faults: dict[int, str] = {}
        logits = apply_controls(logits, rows, faults, pending)
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
            lp, _ = _log_softmax_rows(logits, params, wanted)
            chosen = to_device([tokens[i] for i in wanted], torch.long, logits.device)
            values = lp.gather(1, chosen[:, None])[:, 0].tolist()
            result.log_probs = [None] * len(rows)
            for i, v in zip(wanted, values, strict=True):
                result.log_probs[i] = v
            counts = [rows[i].state.controls.top_log_probs for i in wanted]  # type: ignore[union-attr]
            if any(counts):
                result.top_log_probs = [None] * len(rows)
                ranks = _ranks(lp, lp.gather(1, chosen[:, None])[:, 0]).tolist()
                for i, top in zip(wanted, _top_log_probs(lp, counts, ranks), strict=True):
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


def _controlled_row(request: LlmRequest) -> LogitsRow | None:
    """The request's row for :func:`apply_controls` where a control rewrites its logits, else None."""
    state = request.decoding
    if state is None or not state.controls.processes_logits:
        return None
    return _logits_row(request, state)


def _logits_row(request: LlmRequest, state: DecodingState) -> LogitsRow:
    """The request's tokens so far (its pending ones counted, not listed) under ``state``."""
    return LogitsRow(
        request.request_id,
        state,
        request.prompt_ids,
        request.output_ids,
        request.sampling.end_id,
        request.num_pending,
    )


def _log_softmax_rows(
    logits: torch.Tensor, params: Sequence[Sampling], wanted: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits / temperature)`` of the ``wanted`` rows (temperature 1 for greedy rows),
    and their index on the device. One computation for both decode paths, so their log probs are the
    same bits; only the wanted rows are widened to float32 (the device path's logits may be 16-bit)."""
    dev = logits.device
    index = to_device(wanted, torch.long, dev)
    temperature = to_device(
        [params[i].temperature if not params[i].is_greedy else 1.0 for i in wanted], torch.float32, dev
    )
    return torch.log_softmax(logits.index_select(0, index).float() / temperature[:, None], dim=-1), index


def _top_log_probs(
    lp: torch.Tensor, counts: list[int], ranks: list[int]
) -> list[list[tuple[int, float]] | None]:
    """Each row's ``counts[i]`` most likely (token, log prob) pairs, most likely first, with the chosen
    token's rank: one topk over the rows for the largest count, one copy to the host."""
    values, ids = lp.topk(max(counts), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [_top(ids[j][:k], values[j][:k], ranks[j]) if k else None for j, k in enumerate(counts)]


def _ranks(lp: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Each row's chosen token's rank in its whole distribution: 1 + the tokens strictly more likely
    (vLLM's rank), so a chosen token outside the top ones still has its true rank."""
    return (lp > chosen[:, None]).sum(-1) + 1


def _top(ids: list[int], values: list[float], rank: int) -> TopLogProbs:
    top = TopLogProbs(zip(ids, values, strict=True))
    top.rank = int(rank)
    return top


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
