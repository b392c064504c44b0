"""``bm.LLM``'s values: the parameters a request takes and the outputs it returns, in vLLM's shapes.

Why their own module: these are the library's contract with a vLLM user (the names, their defaults,
what comes back), and every name here maps onto one engine field of :mod:`bm.engine.requests.fields`, the one
table every door of bm reads. Nothing here checks a value by itself: each is handed to that table's
checks (``request_field``) when the parameters are built, and to the engine's one validator
(:func:`bm.engine.requests.validate.validate_request`) before a batch starts, so a bad value is refused with
the same rule whichever door it came in by, and raised here as :class:`InvalidParameterError`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, NamedTuple, TypeVar

from bm.config import ConfigError
from bm.config.vllm import NotInBm
from bm.engine.requests.fields import (
    VLLM_SAMPLING_FIELDS,
    RequestError,
    check_bool,
    check_int,
    in_user_terms,
    request_field,
)
from bm.suggest import did_you_mean


class InvalidParameterError(RequestError, ConfigError):
    """A parameter ``bm.LLM`` cannot run, raised before anything runs; the message names the field and
    the fix. One type for both kinds a vLLM user hands over (``SamplingParams`` fields and ``LLM(...)``
    keywords), and a ``ValueError``, as vLLM raises."""


# vLLM's SamplingParams name -> the engine request field it sets, for the mapping test, the docs and the
# messages: an engine error names the field the user wrote, not the spec's name. One table with bm's JSONL
# and OpenAI bodies (bm.engine.requests.fields); ``prompt_logprobs`` asks for the prompt's logits, made log
# probs here.
SAMPLING_FIELDS: dict[str, str] = VLLM_SAMPLING_FIELDS
# vLLM's SamplingParams names that set no engine field: they shape the text and outputs bm.LLM returns
# (best_of is honoured when it equals n: bm returns every sample it draws).
OUTPUT_FIELDS = (
    "best_of",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)
# vLLM's SamplingParams names bm has no counterpart for -> why, the bm way, and the values that ask for
# what bm does anyway (accepted). An unknown name that is none of these gets the nearest one suggested.
VLLM_SAMPLING_ONLY: dict[str, NotInBm] = {
    "logits_processors": NotInBm(
        "bm.LLM runs no Python callback per token",
        "shape the logits with logit_bias, bad_words, min_tokens or structured_outputs",
        inert=(None, []),
    ),
    "allowed_token_ids": NotInBm(
        "bm.LLM has no list of allowed tokens",
        "constrain the output with structured_outputs (choice=[...] or regex=...), or push tokens down "
        "with logit_bias={id: -100}",
        inert=(None,),
    ),
    "truncate_prompt_tokens": NotInBm(
        "bm.LLM runs the whole prompt",
        "pass the last N token ids yourself: llm.get_tokenizer().encode(text)[-N:]",
        inert=(None,),
    ),
    "detokenize": NotInBm(
        "bm.LLM always decodes the text", "read token_ids and leave text aside", inert=(True,)
    ),
    "use_beam_search": NotInBm(
        "beam search is its own call in bm.LLM, as in vLLM",
        "call llm.beam_search(prompts, BeamSearchParams(beam_width=..., max_tokens=...))",
        inert=(False,),
    ),
    "length_penalty": NotInBm(
        "a length penalty applies to beam search, which is its own call in bm.LLM, as in vLLM",
        "call llm.beam_search(prompts, BeamSearchParams(beam_width=..., max_tokens=..., length_penalty=...))",
        inert=(1.0,),
    ),
    "extra_args": NotInBm("bm.LLM reads no extension arguments", "drop it", inert=(None,)),
}

_Init = TypeVar("_Init", bound=type)


def refuse_unknown(
    owner: str, name: str, value: Any, known: Iterable[str], vllm_only: Mapping[str, NotInBm], note: str = ""
) -> None:
    """Judge a keyword ``owner`` has no parameter for: a vLLM name bm lacks is accepted when its value
    asks for what bm does anyway, and otherwise refused saying so and what to use instead; any other
    name is refused with the nearest known one (a typo costs one glance). Raises
    :class:`InvalidParameterError`, a ``ValueError``, where Python would raise ``TypeError``."""
    if name in vllm_only:
        entry = vllm_only[name]
        if entry.accepts(value):
            return
        raise InvalidParameterError(
            f"{owner}({name}={value!r}): a vLLM parameter bm does not take: {entry.why}; {entry.keyword}"
        )
    hint = did_you_mean(name, known)
    raise InvalidParameterError(f"{owner}({name}=...): unknown parameter{hint}{note}")


def refusing_unknown_keywords(vllm_only: Mapping[str, NotInBm]) -> Callable[[_Init], _Init]:
    """A dataclass whose constructor judges unknown keywords with :func:`refuse_unknown` instead of
    raising ``TypeError``: a vLLM user's mistyped or vLLM-only name gets the field and the fix."""

    def wrap(cls: _Init) -> _Init:
        init = cls.__init__
        known = tuple(f.name for f in fields(cls))

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            for name in [k for k in kwargs if k not in known]:
                refuse_unknown(cls.__name__, name, kwargs.pop(name), known, vllm_only)
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return wrap


def user_message(message: str) -> str:
    """An engine message in the library's names (``request_output_len`` -> ``max_tokens``)."""
    message = message.replace("(engine.max_seq_len)", "(LLM(max_model_len=...), engine.max_seq_len)")
    return in_user_terms(message)


@refusing_unknown_keywords(
    {
        "backend": NotInBm(
            "bm compiles structured output with llguidance (vLLM's 'guidance' backend) only",
            "drop it",
            inert=(None, "auto", "guidance"),
        )
    }
)
@dataclass
class StructuredOutputsParams:
    """Structured output in vLLM's shape: give exactly one of ``json`` (a JSON schema, as a dict or JSON
    text), ``regex``, ``choice`` (strings), ``grammar`` (Lark text) or ``json_object=True``. Compiled by
    llguidance (``pip install llguidance``), as bm run's ``guided_*`` fields are."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def spec(self) -> dict[str, Any]:
        """The engine's ``guided_decoding`` object form (``{"json": schema}``, ...)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


GuidedDecodingParams = StructuredOutputsParams  # vLLM's earlier name for the same parameters


@refusing_unknown_keywords(VLLM_SAMPLING_ONLY)
@dataclass
class SamplingParams:
    """Per-request sampling controls under vLLM's names (the engine field each sets: SAMPLING_FIELDS).

    Every value is checked against the engine's field table when the object is built, so a bad one
    raises :class:`InvalidParameterError` here, not an empty answer later; so does a keyword it does
    not take (a vLLM name bm lacks names the bm way, a typo the nearest name). The defaults are vLLM's
    (``temperature`` 1.0: a script written for vLLM samples here as it did there); greedy is
    ``temperature=0``. ``LLM.generate`` without parameters uses :meth:`bm.LLM.get_default_sampling_params`
    (the checkpoint's ``generation_config.json`` over these, as vLLM does).
    """

    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's length (engine.max_seq_len)
    temperature: float = 1.0  # vLLM's default; 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # 0: off; else drop tokens below min_p x the top token's probability
    seed: int | None = None  # None: the LLM's seed, derived per request (else the engine's 0)
    stop: str | list[str] | None = None  # strings that end the text (cut before them, as OpenAI does)
    stop_token_ids: list[int] | None = None  # single tokens that end generation
    bad_words: list[str] | None = None
    ignore_eos: bool = False  # keep going past the model's end token
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # None: no log probs; k: the chosen token's and the k most likely ones' at each position (0-20)
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    # Structured output (needs llguidance): vLLM's StructuredOutputsParams (or its dict form, also under
    # the older name guided_decoding) or OpenAI's response_format. docs/structured-output.md
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    guided_decoding: StructuredOutputsParams | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # None: no prompt log probs; k: each prompt token's (after the first) and the k most likely ones'
    # there, in RequestOutput.prompt_logprobs (0-20)
    prompt_logprobs: int | None = None
    best_of: int | None = None  # None or n: bm returns every sample it draws and ranks none
    skip_special_tokens: bool = True  # False: special tokens written in the text (a checkpoint's tokenizer)
    spaces_between_special_tokens: bool = True  # False is honoured only with skip_special_tokens=True
    include_stop_str_in_output: bool = False  # True: the text keeps the stop string that ended it

    def __post_init__(self) -> None:
        self.request_fields(None)  # checks every value the engine's field table can judge alone

    def request_fields(self, encode_word: Any) -> dict[str, Any]:
        """The engine request's fields for these parameters (strings tokenized by ``encode_word``; None
        checks everything but the strings' tokens). Raises :class:`InvalidParameterError`."""
        try:
            return self._fields(encode_word)
        except RequestError as exc:
            raise InvalidParameterError(f"SamplingParams.{user_message(str(exc))}") from None

    def _fields(self, encode_word: Any) -> dict[str, Any]:
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
        ):
            raise RequestError(
                f"logprobs: expected a count of top log probs (0 returns only the chosen token's), got "
                f"{self.logprobs!r}"
            )
        top_k = self.top_k if self.top_k != -1 else 0  # vLLM's -1 is off, as 0 is
        values = {
            "num_return_sequences": ("n", self.n),
            "temperature": ("temperature", self.temperature),
            "runtime_top_p": ("top_p", self.top_p),
            "runtime_top_k": ("top_k", top_k),
            "min_p": ("min_p", self.min_p),
            "random_seed": ("seed", self.seed),
            "min_length": ("min_tokens", self.min_tokens),
            "repetition_penalty": ("repetition_penalty", self.repetition_penalty),
            "presence_penalty": ("presence_penalty", self.presence_penalty),
            "frequency_penalty": ("frequency_penalty", self.frequency_penalty),
            "top_logprobs": ("logprobs", self.logprobs),
            "logit_bias": ("logit_bias", self.logit_bias),
        }
        out = {name: request_field(name, key, v) for name, (key, v) in values.items() if v is not None}
        if self.max_tokens is not None:
            out["request_output_len"] = check_int("request_output_len", self.max_tokens, "max_tokens", low=1)
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos: expected True or False, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            out["return_log_probs"] = True
            # the most likely token is always asked for, so the chosen one's rank is known when it is 1
            out["top_logprobs"] = max(self.logprobs, 1)
        if self.prompt_logprobs is not None:
            check_int("top_logprobs", self.prompt_logprobs, "prompt_logprobs")
            out["return_context_logits"] = True
        self._check_output_fields()
        out["guided_decoding"] = self._guided()
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        words = [_encode_word(w, "stop", encode_word) for w in stops]
        words += [[t] for t in self.stop_token_ids or []]
        if words:
            out["stop_words_list"] = request_field("stop_words_list", "stop_token_ids", words)
        if self.bad_words:
            bad = [_encode_word(w, "bad_words", encode_word) for w in self.bad_words]
            out["bad_words_list"] = request_field("bad_words_list", "bad_words", bad)
        return {k: v for k, v in out.items() if v is not None}

    def _check_output_fields(self) -> None:
        """The names that shape what LLM returns: each value bm honours, and a refusal naming the bm way
        for what it cannot."""
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"):
            check_bool(getattr(self, name), name)
        if not (self.skip_special_tokens or self.spaces_between_special_tokens):
            raise RequestError(
                "spaces_between_special_tokens: False is not honoured when special tokens are written "
                "(skip_special_tokens=False): the tokenizer's decoder writes them as it does; drop it"
            )
        if self.best_of is None:
            return
        best_of = check_int("num_return_sequences", self.best_of, "best_of")
        if best_of < self.n:
            raise RequestError(f"best_of: must be at least n ({self.n}), got {best_of}")
        if best_of > self.n:
            raise RequestError(
                f"best_of: {best_of} > n ({self.n}) is not supported: bm returns every sample it draws "
                f"and ranks none; ask n={best_of} and keep the best by cumulative_logprob (logprobs=0 "
                "returns it)"
            )

    def _guided(self) -> Any:
        given = {
            name: value
            for name, value in (
                ("structured_outputs", self.structured_outputs),
                ("guided_decoding", self.guided_decoding),
                ("response_format", self.response_format),
            )
            if value is not None
        }
        if len(given) > 1:
            raise RequestError(f"{' and '.join(given)}: give one structured-output field, not both")
        if not given:
            return None
        ((name, value),) = given.items()
        if isinstance(value, StructuredOutputsParams):
            value = value.spec()
        engine_key = "response_format" if name == "response_format" else "guided_decoding"
        spec = request_field("guided_decoding", engine_key, value)
        return spec


def _encode_word(word: Any, name: str, encode_word: Any) -> list[int]:
    """A stop or bad word's token ids ([0] stands in for a string until a tokenizer encodes it)."""
    if not isinstance(word, str) or not word:
        raise RequestError(f"{name}: expected non-empty strings, got {word!r}")
    return [0] if encode_word is None else list(encode_word(word))


class Logprob(NamedTuple):
    """One token's log probability at one position, as vLLM returns it: its ``rank`` among the whole
    vocabulary (1 is the most likely; None when the chosen token was below the top ones asked for)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence: its text, token ids, log probs and why it ended.

    ``logprobs`` (with ``SamplingParams(logprobs=k)``): one dict per generated token, token id ->
    :class:`Logprob`, holding the chosen token and the k most likely ones (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # stop (end token, stop string or token), length, cancelled, error
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    error: str | None = None
    # vLLM's: the stop string or stop token id that ended the text; None for the end token or the length
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """The result of one prompt, as vLLM shapes it (``outputs``: ``n`` of them), with the first
    output's fields also read directly."""

    request_id: str  # vLLM's: a string, the LLM's running count of requests
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # SamplingParams(prompt_logprobs=k): None for the first prompt token (nothing predicts it), then one
    # dict per prompt token: the token and the k most likely ones there, token id -> Logprob (vLLM's shape)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # when the engine saw the request's milestones (bm.llm_types.RequestMetrics), and its adapter
    metrics: Any = None
    lora_request: Any = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        return self.outputs[0].logprobs

    @property
    def error(self) -> str | None:
        return self.outputs[0].error
