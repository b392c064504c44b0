"""Beam search for one request, step by step, with Hugging Face ``generate()``'s selection rules.

Each step takes the request's processed log-probabilities (one row per running beam; one row at the first
step, when only the prompt exists), keeps the ``2 * beam_width`` best continuations over all beams, moves
those that end (end id or the length limit) among the top ``beam_width`` into the finished hypotheses
(scored ``sum of log probs / generated_length ** len_penalty``), and continues with the best
``beam_width`` that did not end. ``early_stopping`` follows TensorRT-LLM's integer: 1 stops once
``beam_width`` hypotheses are finished (HF ``True``), 0 stops when no running beam can beat the worst
finished one by HF's heuristic (HF ``False``), and anything larger never stops early (HF ``"never"``).

The engine owns the KV side: after a step it forks the beams' block tables by :attr:`StepOutcome.parents`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_NEG = -1.0e9


@dataclass
class StepOutcome:
    parents: list[int]  # beam i continues beam parents[i]
    tokens: list[int]  # the token each new beam appended
    done: bool


@dataclass
class Hypothesis:
    tokens: list[int]
    log_probs: list[float]
    score: float  # length-penalised
    ranks: list[int] = field(default_factory=list)  # each token's rank in its parent's distribution


class BeamSearch:
    def __init__(
        self, beam_width: int, max_new_tokens: int, end_id: int, len_penalty: float, early_stopping: int
    ) -> None:
        self.width = beam_width
        self.max_new_tokens = max_new_tokens
        self.end_id = end_id
        self.len_penalty = len_penalty
        self.early_stopping: bool | str = {0: False, 1: True}.get(early_stopping, "never")
        self.tokens: list[list[int]] = [[]]  # running beams (one before the first step)
        self.log_probs: list[list[float]] = [[]]
        self.ranks: list[list[int]] = [[]]
        self.scores = torch.zeros(beam_width)
        self.scores[1:] = _NEG
        self.finished: list[Hypothesis | None] = [None] * beam_width
        self.finished_scores = torch.full((beam_width,), _NEG)
        self.finished_flags = torch.zeros(beam_width, dtype=torch.bool)
        self.improvable = True
        self.length = 0  # generated tokens per running beam

    def step(self, log_probs: torch.Tensor) -> StepOutcome:
        """``log_probs [rows, vocab]`` (processed, float32) for the running beams, in beam order."""
        width, vocab = self.width, log_probs.shape[1]
        log_probs = log_probs.float().cpu()
        if log_probs.shape[0] == 1:
            log_probs = log_probs.expand(width, vocab)
        total = (log_probs + self.scores[:, None]).reshape(1, -1)
        top_scores, top_index = torch.topk(total, k=2 * width)
        top_scores, top_index = top_scores[0], top_index[0]
        top_beams = (top_index // vocab).tolist()
        top_tokens = (top_index % vocab).tolist()
        # each candidate's rank under its parent (1 + tokens strictly more likely), as vLLM reports it
        parent_rows = log_probs[top_beams]
        picked = parent_rows[torch.arange(len(top_tokens)), top_tokens]
        top_ranks = ((parent_rows > picked[:, None]).sum(-1) + 1).tolist()
        new_length = self.length + 1
        ends = torch.tensor([t == self.end_id or new_length >= self.max_new_tokens for t in top_tokens])

        # Finished hypotheses: only the top `width` candidates may enter, and only while improvement is possible.
        penalised = top_scores / (new_length**self.len_penalty)
        if bool(self.finished_flags.all()) and self.early_stopping is True:
            penalised = penalised + _NEG
        if not self.improvable:
            penalised = penalised + _NEG
        just_finished = ends.clone()
        just_finished[width:] = False
        penalised = penalised + (~just_finished).float() * _NEG
        merged = torch.cat((self.finished_scores, penalised))
        keep = torch.topk(merged, k=width)[1].tolist()
        finished, scores, flags = [], [], []
        for k in keep:
            if k < width:
                finished.append(self.finished[k])
                flags.append(bool(self.finished_flags[k]))
            else:
                c = k - width
                parent, token = top_beams[c], top_tokens[c]
                lp = float(log_probs[parent, token])
                finished.append(
                    Hypothesis(
                        self.tokens[parent] + [token],
                        self.log_probs[parent] + [lp],
                        float(merged[k]),
                        self.ranks[parent] + [top_ranks[c]],
                    )
                )
                flags.append(bool(just_finished[c]))
            scores.append(float(merged[k]))
        self.finished = finished
        self.finished_scores = torch.tensor(scores)
        self.finished_flags = torch.tensor(flags)

        # Running beams: the best `width` candidates that did not end.
        running = top_scores + ends.float() * _NEG
        chosen = torch.topk(running, k=width)[1].tolist()
        parents = [top_beams[c] for c in chosen]
        tokens = [top_tokens[c] for c in chosen]
        self.tokens = [self.tokens[p] + [t] for p, t in zip(parents, tokens, strict=True)]
        self.log_probs = [
            self.log_probs[p] + [float(log_probs[p, t])] for p, t in zip(parents, tokens, strict=True)
        ]
        self.ranks = [self.ranks[top_beams[c]] + [top_ranks[c]] for c in chosen]
        self.scores = running[chosen]
        self.length = new_length

        # Whether to go on (HF's early-stop heuristic and stopping conditions).
        if self.early_stopping == "never" and self.len_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = self.length
        best_running = float(self.scores[0]) / (best_length**self.len_penalty)
        worst_finished = float(self.finished_scores.min()) if bool(self.finished_flags.all()) else _NEG
        self.improvable = self.improvable and best_running > worst_finished
        all_full = bool(self.finished_flags.all()) and self.early_stopping is True
        done = not self.improvable or all_full or bool(ends.all())
        return StepOutcome(parents, tokens, done)

    def results(self) -> list[Hypothesis]:
        """The ``beam_width`` best finished hypotheses, best first (an unfilled slot is empty)."""
        return [h if h is not None else Hypothesis([], [], _NEG) for h in self.finished]
