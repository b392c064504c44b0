"""``bm.LLM``: the library's front door, text in and text out, in the shape vLLM users know.

::

    llm = bm.LLM(model="smollm2-135m")
    outs = llm.generate(["The capital of France is"], bm.SamplingParams(max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason

Why a second door beside the seed's ``BatchManager``: the seed's API speaks token ids and tensor maps, and
a user who just wants completions should not have to tokenize, render chat templates, pick the end id
or stitch responses. This door does those once, here, and hands typed core requests to the same engine
(every value is still validated by the engine's one validator). The model loads once per ``LLM``; each
``generate`` call runs its prompts to completion as one batch.

``bm run`` is built on this door too: it loads through ``LLM`` and streams a file's requests through
:meth:`LLM.session`, the same engine session ``generate`` uses, with its own bound on what is in flight.

Defaults differ from vLLM's in one place, on purpose: ``temperature`` defaults to 0 (greedy), as in
TensorRT-LLM and HF ``generate()``, so that results are reproducible unless sampling is asked for.
Generation stops at the model's end token unless ``ignore_eos`` is set (the seed's library default of
end id -1 never stops, which surprises everyone who did not ask for it).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from bm.config import MODEL_PRESETS, BmConfig, load_config, resolve_engine
from bm.engine.fields import request_field, token_id_list
from bm.engine.offline import RequestQueue
from bm.engine.request import Request, Response
from bm.engine.stopping import text_before_stop

Prompt = str | Sequence[int]
Messages = list[dict[str, Any]]


@dataclass
class SamplingParams:
    """Per-request sampling controls, under vLLM's names (the engine's spec names in comments)."""

    max_tokens: int = 16  # request_output_len
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0  # runtime_top_p
    top_k: int = 0  # runtime_top_k; 0 (or -1) is off
    seed: int | None = None  # random_seed (default 0, as in TensorRT-LLM)
    stop: str | list[str] | None = None  # strings that end the text (cut before them, as OpenAI does)
    stop_token_ids: list[int] | None = None  # single tokens that end generation
    bad_words: list[str] | None = None  # bad_words_list
    ignore_eos: bool = False  # keep going past the model's end token
    min_tokens: int = 0  # min_length
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False  # return_log_probs: the log prob of each generated token
    # Structured output (guided_decoding; needs llguidance): OpenAI's response_format, e.g.
    # {"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}}, or vLLM's guided form,
    # {"json": schema} | {"regex": "..."} | {"choice": [...]} | {"grammar": "..."}. docs/structured-output.md
    response_format: dict[str, Any] | None = None
    guided_decoding: Any = None

    def request_fields(self, encode_word: Any) -> dict[str, Any]:
        """The engine request's fields for these parameters (strings tokenized by ``encode_word``)."""
        out: dict[str, Any] = {
            "request_output_len": self.max_tokens,
            "temperature": self.temperature,
            "runtime_top_p": self.top_p,
            "runtime_top_k": max(self.top_k, 0),
            "random_seed": self.seed,
            "min_length": self.min_tokens or None,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "return_log_probs": self.logprobs or None,
        }
        if self.response_format is not None and self.guided_decoding is not None:
            raise ValueError("SamplingParams: give response_format or guided_decoding, not both")
        if self.response_format is not None:
            out["guided_decoding"] = request_field("guided_decoding", "response_format", self.response_format)
        elif self.guided_decoding is not None:
            out["guided_decoding"] = request_field("guided_decoding", "guided_decoding", self.guided_decoding)
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        words = [_encode_word(w, "stop", encode_word) for w in stops]
        words += [[t] for t in self.stop_token_ids or []]
        if words:
            out["stop_words_list"] = words
        if self.bad_words:
            out["bad_words_list"] = [_encode_word(w, "bad_words", encode_word) for w in self.bad_words]
        return out


def _encode_word(word: Any, name: str, encode_word: Any) -> list[int]:
    if not isinstance(word, str) or not word:
        raise ValueError(f"SamplingParams.{name}: expected non-empty strings, got {word!r}")
    if encode_word is None:
        raise ValueError(f"SamplingParams.{name}: this model has no tokenizer to encode {word!r}")
    return list(encode_word(word))


@dataclass
class CompletionOutput:
    """One generated sequence: its text, token ids, per-token log probs and why it ended."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # stop (end token, stop string or token), length, cancelled, error
    logprobs: list[float] | None = None
    cumulative_logprob: float | None = None
    error: str | None = None


@dataclass
class RequestOutput:
    """The result of one prompt, as vLLM shapes it (``outputs[0]``), with its fields also read directly."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True

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
    def logprobs(self) -> list[float] | None:
        return self.outputs[0].logprobs

    @property
    def error(self) -> str | None:
        return self.outputs[0].error


# The engine's finish reasons under the names OpenAI and vLLM use.
_FINISH = {
    "end_id": "stop",
    "stop_words": "stop",
    "length": "length",
    "cancelled": "cancelled",
    "error": "error",
}


class LLM:
    """A model loaded once, and generation over lists of prompts or chats.

    ``model``: a preset (``smollm2-135m``, ``tiny-random``) or a local Hugging Face checkpoint directory.
    ``config``: a YAML config file or a :class:`~bm.config.BmConfig`. Other keyword arguments are config
    sections as mappings (``engine={"max_batch_size": 64}``, ``kv_cache={"max_tokens": 16384}``) or keys
    of the ``model`` section (``dtype="bfloat16"``, ``device="cpu"``). Every value is checked at once, with
    the same messages as ``bm run --set``.
    """

    def __init__(
        self, model: str | None = None, *, config: str | Path | BmConfig | None = None, **options: Any
    ):
        from bm.runtime import load_model

        config_ = _build_config(model, config, options)
        self.loaded = load_model(config_.model)
        # the budgets left unset take the model's device's defaults (bm.config.resolve_engine), so what
        # this object reports is what its engines run
        self.config = resolve_engine(config_, self.loaded.device_type)
        self.tokenizer = self.loaded.tokenizer
        self._next_id = 0
        self._executor: Any = None  # one executor for every engine of this object: one cache, one warm-up
        self._prepare_engine()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in order. A prompt is text or a list of token ids; one
        ``SamplingParams`` serves every prompt, or give a list with one per prompt."""
        single = isinstance(prompts, (str, Mapping)) or hasattr(prompts, "tolist") or _is_ids(prompts)
        batch = [prompts] if single else list(prompts)
        return self._run(
            [(p, self._encode(p)) if isinstance(p, str) else (None, _ids(p)) for p in batch], sampling_params
        )

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to chats (OpenAI-style ``[{"role": ..., "content": ...}]`` turns), each rendered
        with the model's chat template (or ``chat_template``, Jinja text) and its generation prompt."""
        from bm.runtime.tokenizer import chat_renderer

        chats = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        render = chat_renderer(self.tokenizer, chat_template)
        if render is None:
            raise ValueError(
                "this model has no chat template; pass chat_template= (Jinja text) or use generate()"
            )
        return self._run([(None, render(list(chat))) for chat in chats], sampling_params)

    def session(self, return_stats: Callable[[str], None] | None = None) -> Session:
        """An engine over this model that takes typed core requests one at a time and hands back each
        request's final response as it finishes: what ``generate`` and ``bm run`` both drive. Under
        ``torchrun`` it is the data-parallel coordinator. Close it (or use ``with``) to stop the engine."""
        return Session(self, return_stats)

    # -- inside -----------------------------------------------------------------------------------------

    def _engine_executor(self) -> Any:
        """The executor every engine of this object runs on (None under several ranks, where each rank
        builds its own): its KV cache, CUDA graphs and warm-up outlive one ``generate`` call."""
        from bm.distributed.layout import current_layout

        if current_layout().is_distributed:
            return None
        if self._executor is None:
            from bm.runtime.executor import TorchExecutor

            self._executor = TorchExecutor(self.loaded)
        return self._executor

    def _prepare_engine(self) -> None:
        """Build an engine once now, so the KV cache is allocated and the warm-up (compiles, CUDA graph
        captures) done before the first ``generate``, as vLLM's ``LLM`` does at construction; what it
        cost is :attr:`startup`."""
        self.startup: dict[str, Any] = {"load_model_s": self.loaded.load_seconds}
        if self._engine_executor() is None:
            return
        started = time.perf_counter()
        session = self.session()
        self.startup |= {"engine_build_s": time.perf_counter() - started, "warmup": session.warmup}
        session.close()

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
        return self.tokenizer.encode(text)

    def _run(
        self,
        prompts: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        params = _per_prompt(sampling_params, len(prompts))
        encode_word = getattr(self.tokenizer, "encode_word", None)
        first = self._next_id
        self._next_id += len(prompts)
        requests = []
        for i, ((_text, ids), p) in enumerate(zip(prompts, params, strict=True)):
            fields_ = {k: v for k, v in p.request_fields(encode_word).items() if v is not None}
            end_id = None if p.ignore_eos else self.loaded.eos_token_id
            requests.append(Request(first + i, input_ids=ids, end_id=end_id, **fields_))
        with self.session() as session:
            for request in requests:
                session.submit(request)
            results = {}
            while len(results) < len(requests):
                response = session.next_final()
                if response is not None:
                    results[response.request_id] = response
                elif not session.alive:
                    raise RuntimeError(f"the batch manager failed: {session.error}")
        return [
            self._output(first + i, text, ids, p, results[first + i])
            for i, ((text, ids), p) in enumerate(zip(prompts, params, strict=True))
        ]

    def _output(
        self,
        request_id: int,
        prompt: str | None,
        ids: list[int],
        params: SamplingParams,
        result: Response,
    ) -> RequestOutput:
        tokens = list(result.output_ids)
        reason = _FINISH.get(result.finish_reason.label, result.finish_reason.label)
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        cut = text_before_stop(text, stops)
        if cut is not None:
            text, reason = cut, "stop"
        cumulative = result.cum_log_probs[0] if result.cum_log_probs else None
        completion = CompletionOutput(
            0, text, tokens, reason, result.output_log_probs, cumulative, result.error or None
        )
        return RequestOutput(request_id, prompt, ids, [completion])


class Session:
    """Requests in, final responses out, over one engine loop (see :meth:`LLM.session`).

    Requests wait in a queue the engine pulls from as it has room; :meth:`cancel` stops handing them out
    and ends the active ones as ``cancelled``, and :meth:`take_pending` returns those never handed out, so
    an interrupted caller can still account for every request."""

    def __init__(self, llm: LLM, return_stats: Callable[[str], None] | None = None) -> None:
        from bm.distributed.engine import engine_loop

        self._pending = RequestQueue()
        self._finished: queue.Queue[Response] = queue.Queue()
        self.stopped = False
        self._manager = engine_loop(
            llm.config,
            self._get_requests,
            self._on_response,
            return_stats=return_stats,
            model=llm.loaded,
            **({"executor": executor} if (executor := llm._engine_executor()) is not None else {}),
        )

    @property
    def warmup(self) -> dict[str, Any] | None:
        """The engine's warm-up report (None when it ran none, or reused an earlier one's)."""
        core = getattr(self._manager, "core", None)
        return getattr(core, "warmup", None)

    def submit(self, request: Request) -> None:
        self._pending.put(request)

    def next_final(self, timeout: float = 0.1) -> Response | None:
        """The next request's final response, or None when none finished within ``timeout`` seconds."""
        try:
            return self._finished.get(timeout=timeout)
        except queue.Empty:
            return None

    @property
    def alive(self) -> bool:
        """False once the engine's worker has stopped (after :meth:`close`, or when it failed)."""
        return self._manager.is_alive()

    @property
    def error(self) -> BaseException | None:
        return getattr(self._manager, "error", None)

    def cancel(self) -> None:
        """Hand out nothing more, and end the active requests at the next iteration as ``cancelled``."""
        self.stopped = True
        self._manager.cancel_all()

    def take_pending(self) -> list[Request]:
        """Every request not yet handed to the engine, removed; nothing more is handed out after this."""
        self.stopped = True
        return self._pending.take_all()

    def close(self) -> None:
        self._manager.shutdown(cancel=True)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get_requests(self, max_new: int) -> list[Request]:
        return [] if self.stopped else self._pending.take(max_new)

    def _on_response(self, response: Response) -> None:
        if response.final:  # the engine's thread; a request's one final response (nothing streams here)
            self._finished.put(response)


def _build_config(
    model: str | None, config: str | Path | BmConfig | None, options: dict[str, Any]
) -> BmConfig:
    """A validated config from a file or object plus keyword overrides (see :class:`LLM`)."""
    from bm.config import ModelConfig, config_from_dict

    model_keys = {f.name for f in fields(ModelConfig)}
    overrides: dict[str, Any] = {}
    if model is not None:
        preset = model in MODEL_PRESETS and not Path(model).exists()
        overrides["model.preset" if preset else "model.path"] = model
    for name, value in options.items():
        if name in model_keys:
            overrides[f"model.{name}"] = value
        elif isinstance(value, Mapping):
            overrides.update({f"{name}.{key}": v for key, v in value.items()})
        else:
            raise ValueError(
                f"LLM({name}=...): not a model key ({', '.join(sorted(model_keys))}) nor a config section "
                "given as a mapping, e.g. engine={'max_batch_size': 64}"
            )
    if isinstance(config, BmConfig) and not overrides:
        return config  # already validated (the CLI builds its config from files and flags)
    if isinstance(config, BmConfig):
        data = config.to_dict()
        for dotted, value in overrides.items():
            section, _, key = dotted.partition(".")
            data.setdefault(section, {})[key] = value
        return config_from_dict(data)
    return load_config(config, overrides)


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(t, int) for t in value)
        and bool(value)
    )


def _ids(value: Any) -> list[int]:
    ids = token_id_list(value)
    if not ids:
        raise ValueError("a prompt must be text or a non-empty list of token ids, got an empty list")
    return ids


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(
            f"sampling_params: {len(params)} given for {count} prompts; give one, or one per prompt"
        )
    return params
