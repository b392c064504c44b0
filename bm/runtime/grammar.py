"""Structured output in the runtime: one grammar matcher per request, and the batch's token masks.

The engine core carries each request's :class:`~bm.engine.requests.structured.GuidedSpec` (plain, hashable);
here it becomes an llguidance matcher. Every distinct spec is compiled once per executor (a pristine matcher
is kept per spec and each request gets a copy, which shares the compiled grammar). The matcher follows
the tokens the core accepted, not the tokens the sampler proposed: before each mask it consumes the
request's new ``output_ids`` (and rolls back any the core dropped), so a chunked prompt (masks apply
only where a token is sampled), a pause and resume (the state lives with the request until it ends) and
block reuse (which changes no token) need nothing of their own.

Each step, the masks of all the batch's guided rows are filled into one bitmask by llguidance's
parallel executor, and applied to the logits with one ``torch.minimum`` over the batch (:class:`MaskApplier`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bm.engine.requests.request import RequestError
from bm.engine.requests.structured import GuidedSpec, load_llguidance
from bm.runtime.tokenizer import ByteTokenizer, HFTokenizer, TextCodec

_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass(eq=False)
class GrammarState:
    """One request's matcher and how many of its output tokens the matcher has consumed."""

    matcher: Any  # llguidance.LLMatcher
    eos_token_id: int
    num_consumed: int = 0

    def sync(self, output_ids: Sequence[int]) -> str:
        """Bring the matcher to ``output_ids``; returns why it cannot follow them ('' when it can)."""
        if self.num_consumed > len(output_ids):
            self.matcher.rollback(self.num_consumed - len(output_ids))
            self.num_consumed = len(output_ids)
        new = list(output_ids[self.num_consumed :])
        if new and not self.matcher.is_stopped():
            self.matcher.consume_tokens(new)
        # past the grammar's end (a request whose end id is another token goes on): nothing to follow
        self.num_consumed = len(output_ids)
        if self.matcher.is_error():
            return f"structured output: the grammar cannot continue: {self.matcher.get_error()}"
        return ""


class GrammarRuntime:
    """The executor's structured-output state: the grammar library's view of the tokenizer (built at the
    first guided request; a run without one never imports the library) and the compiled specs."""

    def __init__(self, tokenizer: TextCodec | None, vocab_size: int, eos_token_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._ll: Any = None
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._compiled: dict[GuidedSpec, Any] = {}

    @property
    def num_compiled(self) -> int:
        """Distinct specs compiled so far (each once per run)."""
        return len(self._compiled)

    def start(self, spec: GuidedSpec) -> GrammarState:
        """A fresh matcher for a request; :class:`RequestError` when this model or spec cannot have one."""
        pristine = self._compiled.get(spec)
        if pristine is None:
            ll, tokenizer = self._library()
            pristine = ll.LLMatcher(tokenizer, spec.grammar(), log_level=0)
            if pristine.is_error():
                raise RequestError(f"guided_decoding: the grammar cannot be compiled: {pristine.get_error()}")
            self._compiled[spec] = pristine
        return GrammarState(pristine.deep_copy(), self._ll_tokenizer.eos_token)

    def _library(self) -> tuple[Any, Any]:
        if self._ll_tokenizer is None:
            ll = load_llguidance()
            self._ll_tokenizer = ll_tokenizer(ll, self.tokenizer, self.vocab_size, self.eos_token_id)
            self._executor = ll.LLExecutor(num_threads=max(1, min(4, torch.get_num_threads())))
            self._ll = ll
        return self._ll, self._ll_tokenizer

    def fill(self, states: Sequence[GrammarState]) -> torch.Tensor:
        """``[len(states), ceil(vocab / 32)]`` int32: bit ``t`` of row ``i`` set when token ``t`` may come
        next for ``states[i]`` (matchers already synced), filled in one parallel call. A finished
        grammar's row allows its end token only, so a request whose end id is another token still gets
        a usable row instead of none."""
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros((len(states), words), dtype=torch.int32)
        pairs = [(s.matcher, i) for i, s in enumerate(states)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(states))
        for i, state in enumerate(states):
            if state.matcher.is_stopped():
                bitmask[i].zero_()
                bitmask[i, state.eos_token_id // 32] = _bit(state.eos_token_id % 32)
        return bitmask


def _bit(position: int) -> int:
    """The int32 value with only bit ``position`` set (bit 31 is the sign bit)."""
    value = 1 << position
    return value - (1 << 32) if value >= 1 << 31 else value


class MaskApplier:
    """Applies a batch's bitmask to its logits with one ``torch.minimum`` over the whole batch: each
    allowed token's bound is +inf (the logit stays), each other's -inf. Rows without a grammar get +inf
    throughout. The buffers persist across steps and are written in place: at 32 x 49152 a fresh
    6 MB tensor per step costs more in page faults than the arithmetic does."""

    def __init__(self) -> None:
        self._allowed: torch.Tensor | None = None  # [rows, vocab] uint8, 1 where allowed
        self._bound: torch.Tensor | None = None  # [rows, vocab] in the logits' dtype: +inf or -inf

    def apply(self, logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
        """Set ``logits[rows[i], t]`` to -inf wherever bit ``t`` of ``bitmask[i]`` is clear."""
        num_rows, vocab = logits.shape
        allowed, bound = self._buffers(num_rows, vocab, logits)
        unpacked = _unpack(bitmask, vocab, logits.device)
        if len(rows) == num_rows and list(rows) == list(range(num_rows)):
            allowed.copy_(unpacked)
        else:
            allowed.fill_(1)
            allowed.index_copy_(0, torch.tensor(list(rows), device=logits.device), unpacked)
        bound.copy_(allowed).sub_(0.5).mul_(float("inf"))  # 1 -> +inf, 0 -> -inf
        torch.minimum(logits, bound, out=logits)

    def _buffers(self, num_rows: int, vocab: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bound = self._bound
        if (
            bound is None
            or bound.shape[0] < num_rows
            or bound.shape[1] != vocab
            or bound.dtype != logits.dtype
            or bound.device != logits.device
        ):
            size = max(num_rows, bound.shape[0] if bound is not None else 0)
            self._allowed = torch.empty((size, vocab), dtype=torch.uint8, device=logits.device)
            self._bound = torch.empty((size, vocab), dtype=logits.dtype, device=logits.device)
        return self._allowed[:num_rows], self._bound[:num_rows]  # type: ignore[index]


def _unpack(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """``[rows, vocab]`` uint8, 1 where the bit is set: numpy's unpack on the host (one C pass), torch's
    shifts on a device (the packed mask travels, 32 times smaller)."""
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab])
    shifts = _SHIFTS.to(device)
    bits = (bitmask.to(device, non_blocking=True).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].to(torch.uint8)


def ll_tokenizer(ll: Any, tokenizer: TextCodec | None, vocab_size: int, eos_token_id: int | None) -> Any:
    """llguidance's tokenizer for bm's: a Hugging Face fast tokenizer as is, the byte tokenizer of the
    embedded model from its byte table."""
    if isinstance(tokenizer, HFTokenizer):
        from llguidance.hf import from_tokenizer

        try:
            return from_tokenizer(tokenizer.tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
        except ValueError as exc:
            raise RequestError(
                f"guided_decoding: this model's tokenizer cannot drive a grammar: {exc}"
            ) from None
    if isinstance(tokenizer, ByteTokenizer):
        return ll.LLTokenizer(ll.TokenizerWrapper(_ByteTable(tokenizer, vocab_size)), n_vocab=vocab_size)
    raise RequestError("guided_decoding: structured output needs the model's tokenizer; this model has none")


class _ByteTable:
    """The byte tokenizer as llguidance's TokenizerWrapper reads one: each id's bytes and an encoder."""

    def __init__(self, tokenizer: ByteTokenizer, vocab_size: int) -> None:
        specials = [b"<pad>", b"<s>", b"</s>"]
        self.tokens = specials + [bytes([b]) for b in range(256)]
        self.tokens += [f"<unused{i}>".encode() for i in range(len(self.tokens), vocab_size)]
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [0, 1, 2, *range(ByteTokenizer.vocab_size, vocab_size)]
        self._shift = tokenizer.num_special

    def __call__(self, data: bytes) -> list[int]:
        return [b + self._shift for b in data]
