"""The optional response tensors of the spec: beams, log probs and logits, in the spec's shapes."""

from __future__ import annotations

import torch

from bm.scheduling import FinishReason, LlmRequest


def log_probs(req: LlmRequest, start: int) -> dict[str, torch.Tensor]:
    """``output_log_probs [1, 1, new tokens]`` (the tokens this response carries) and ``cum_log_probs [1, 1]``
    (all tokens so far)."""
    values = req.output_log_probs or []
    return {
        "output_log_probs": torch.tensor([[values[start:]]], dtype=torch.float32),
        "cum_log_probs": torch.tensor([[sum(values)]], dtype=torch.float32),
    }


def beam_outputs(req: LlmRequest) -> dict[str, torch.Tensor]:
    """``output_ids [beam_width, n]`` padded with the end id (or pad id), best beam first.

    A request that ended normally returns its finished hypotheses; a cancelled one its running beams.
    """
    search = req.decoding.beam
    if req.finish_reason in (FinishReason.END_ID, FinishReason.LENGTH):
        hyps = search.results()
        beams, lps = [h.tokens for h in hyps], [h.log_probs for h in hyps]
    else:
        beams, lps = search.tokens, search.log_probs
    width = max((len(b) for b in beams), default=0)
    fill = req.sampling.end_id if req.sampling.end_id >= 0 else req.sampling.pad_id
    ids = torch.full((len(beams), width), fill, dtype=torch.int32)
    lp = torch.zeros((1, len(beams), width), dtype=torch.float32)
    for b, (tokens, values) in enumerate(zip(beams, lps, strict=True)):
        ids[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        lp[0, b, : len(values)] = torch.tensor(values, dtype=torch.float32)
    tensors = {
        "output_ids": ids,
        "sequence_length": torch.tensor([len(b) for b in beams], dtype=torch.int32),
    }
    if req.decoding.return_log_probs:
        tensors["output_log_probs"] = lp
        tensors["cum_log_probs"] = torch.tensor([[float(sum(v)) for v in lps]], dtype=torch.float32)
    return tensors


def logits(req: LlmRequest) -> dict[str, torch.Tensor]:
    """``context_logits [1, prompt, vocab]`` and ``generation_logits [1, 1, output, vocab]`` when asked."""
    opts = req.decoding
    tensors = {}
    if opts.return_context_logits and opts.context_logits:
        tensors["context_logits"] = torch.cat(opts.context_logits)[None]
    if opts.return_generation_logits and opts.generation_logits:
        tensors["generation_logits"] = torch.stack(opts.generation_logits)[None, None]
    return tensors
