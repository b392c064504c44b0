"""``bm.LLM``: the library's front door, text in and text out, in the shape vLLM users know.

::

    llm = bm.LLM(model="smollm2-135m")
    outs = llm.generate(["The capital of France is"], bm.SamplingParams(max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason

Why a second door beside the seed's ``BatchManager``: the seed's API speaks token ids and tensor maps, and
a user who just wants completions should not have to tokenize, render chat templates, pick the end id
or stitch responses. This door does those once, here, and hands typed core requests to the same engine
(every value is still validated by the engine's one validator, before any request of a batch runs,
and a bad one raises :class:`~bm.llm_params.InvalidParameterError`). The model loads once per ``LLM``; each
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bm.config import BmConfig, resolve_engine
from bm.engine.fields import RequestError, token_id_list
from bm.engine.offline import RequestQueue
from bm.engine.request import Request, Response
from bm.engine.stopping import text_before_stop, text_through_stop
from bm.llm_config import build_config, check_tensor_parallel
from bm.llm_params import (
    CompletionOutput,
    GuidedDecodingParams,
    InvalidParameterError,
    Logprob,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
    user_message,
)

__all__ = [
    "LLM",
    "CompletionOutput",
    "GuidedDecodingParams",
    "InvalidParameterError",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "Session",
    "StructuredOutputsParams",
]

Prompt = str | Sequence[int]
Messages = list[dict[str, Any]]

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
    ``config``: a YAML config file or a :class:`~bm.config.BmConfig`. Keywords: vLLM's engine arguments
    (``max_model_len``, ``gpu_memory_utilization``, ``dtype``, ``max_num_seqs``, ... mapped by
    :data:`bm.llm_config.ENGINE_ARGS`), keys of the ``model`` section (``device="cpu"``) and config
    sections as mappings (``engine={"max_batch_size": 64}``). ``seed`` seeds sampling, as in vLLM: each
    request without a seed of its own samples with one derived from it and the request's number (the
    random weights' seed is ``model={"seed": ...}``). Every value is checked at once, with the same
    messages as ``bm run --set``, and a bad one raises :class:`InvalidParameterError`.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: str | Path | BmConfig | None = None,
        seed: int | None = None,
        tensor_parallel_size: int | None = None,
        **options: Any,
    ):
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise InvalidParameterError(f"LLM(seed=...): expected an integer >= 0, got {seed!r}")
        if tensor_parallel_size is not None:  # None: the ranks this process already runs in
            check_tensor_parallel(tensor_parallel_size)
        config_ = build_config(model, config, options)
        from bm.model_fit import load_fitting_model  # the runtime: once every keyword is judged

        self.seed = seed
        self.loaded = load_fitting_model(config_.model)
        # the budgets left unset take the model's device's defaults (bm.config.resolve_engine), so what
        # this object reports is what its engines run
        self.config = resolve_engine(config_, self.loaded.device_type)
        self.tokenizer = self.loaded.tokenizer
        self._next_id = 0
        self._executor: Any = None  # one executor for every engine of this object: one cache, one warm-up
        self._prepare_engine()
        self._limits = self._request_limits()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in order. A prompt is text or a list of token ids; one
        ``SamplingParams`` serves every prompt, or give a list with one per prompt. Every request is
        validated before any runs; a bad one raises :class:`InvalidParameterError`. ``use_tqdm`` shows
        a progress bar on stderr (rich's) while the batch runs."""
        single = isinstance(prompts, (str, Mapping)) or hasattr(prompts, "tolist") or _is_ids(prompts)
        batch = [prompts] if single else list(prompts)
        return self._run(
            [(p, self._encode(p)) if isinstance(p, str) else (None, _ids(p)) for p in batch],
            sampling_params,
            use_tqdm,
        )

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to chats (OpenAI-style ``[{"role": ..., "content": ...}]`` turns), each rendered
        with the model's chat template (or ``chat_template``, Jinja text) and its generation prompt;
        ``tools`` (OpenAI's function specs) are handed to the template, which writes them as the model
        was trained to read them."""
        from bm.runtime.tokenizer import chat_renderer

        chats = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        render = chat_renderer(self.tokenizer, chat_template)
        if render is None:
            raise InvalidParameterError(
                "this model has no chat template; pass chat_template= (Jinja text) or use generate()"
            )
        if tools is not None and (
            not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise InvalidParameterError(
                "tools: expected a list of tool objects, e.g. [{'type': 'function', ...}]"
            )
        return self._run(
            [(None, render(list(chat), tools=tools)) for chat in chats], sampling_params, use_tqdm
        )

    def get_tokenizer(self) -> Any:
        """The model's tokenizer: the Hugging Face one of a checkpoint (as vLLM returns it), or bm's byte
        tokenizer for the embedded random model; None for a model without one."""
        return getattr(self.tokenizer, "tokenizer", self.tokenizer)

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
            from bm.runtime.executor import executor_for

            self._executor = executor_for(self.loaded)  # the model's: a run_bench over it shares it too
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

    def _request_limits(self) -> Any:
        """What the engine validates a request against, so a batch is checked before any of it runs."""
        from bm.engine.executor import ModelLimits
        from bm.engine.setup import request_limits

        executor = self._engine_executor()
        model = executor.limits if executor is not None else ModelLimits(
            vocab_size=self.loaded.vocab_size, max_position_embeddings=self.loaded.max_position_embeddings
        )  # fmt: skip
        return request_limits(self.config, model)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidParameterError("this model has no tokenizer; pass prompts as lists of token ids")
        return self.tokenizer.encode(text)

    def _requests(
        self, prompts: list[tuple[str | None, list[int]]], params: list[SamplingParams], first: int
    ) -> list[Request]:
        """One engine request per prompt, each checked by the engine's validator before any is sent."""
        from bm.engine.seeds import line_seed
        from bm.engine.validate import validate_request

        encode_word = getattr(self.tokenizer, "encode_word", None)
        requests = []
        for i, ((_text, ids), p) in enumerate(zip(prompts, params, strict=True)):
            fields_ = p.request_fields(encode_word)
            self._check_output_params(p)
            if "request_output_len" not in fields_:  # max_tokens=None: up to the model's length
                fields_["request_output_len"] = max(self._limits.max_seq_len - len(ids), 1)
            if "random_seed" not in fields_ and self.seed is not None:
                fields_["random_seed"] = line_seed(self.seed, first + i)
            end_id = None if p.ignore_eos else self.loaded.eos_token_id
            request = Request(first + i, input_ids=ids, end_id=end_id, **fields_)
            try:
                validate_request(request, self._limits)
            except RequestError as exc:
                raise InvalidParameterError(f"prompt {i}: {user_message(str(exc))}") from None
            requests.append(request)
        return requests

    def _check_output_params(self, params: SamplingParams) -> None:
        """What only this model can judge of the parameters that shape the output LLM returns."""
        if not params.skip_special_tokens and getattr(self.tokenizer, "tokenizer", None) is None:
            raise InvalidParameterError(
                "SamplingParams.skip_special_tokens: False writes special tokens as the tokenizer spells "
                "them, and this model's tokenizer (bm's byte tokenizer, or none) has no text for them; "
                "use a checkpoint with a tokenizer, or read them from token_ids"
            )

    def _run(
        self,
        prompts: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        params = _per_prompt(sampling_params, len(prompts))
        first = self._next_id
        requests = self._requests(prompts, params, first)
        self._next_id += len(prompts)
        results: dict[int, Response] = {}
        with self.session() as session, _progress(use_tqdm, len(requests)) as advance:
            for request in requests:
                session.submit(request)
            while len(results) < len(requests):
                response = session.next_final()
                if response is not None:
                    results[response.request_id] = response
                    advance()
                elif not session.alive:
                    raise RuntimeError(f"the batch manager failed: {session.error}")
        for i, request in enumerate(requests):
            error = results[request.request_id].error
            if error:  # refused when admitted (the cache cannot hold it, ...) or failed while running
                kind = RuntimeError if results[request.request_id].output_ids else InvalidParameterError
                raise kind(f"prompt {i}: {user_message(error)}")
        return [
            self._output(first + i, text, ids, p, results[first + i])
            for i, ((text, ids), p) in enumerate(zip(prompts, params, strict=True))
        ]

    def _output(
        self, request_id: int, prompt: str | None, ids: list[int], params: SamplingParams, result: Response
    ) -> RequestOutput:
        samples = result.samples or [result]
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = self._prompt_logprobs(ids, result.context_logits, params.prompt_logprobs)
        completions = [self._completion(i, s, params) for i, s in enumerate(samples)]
        return RequestOutput(request_id, prompt, ids, completions, prompt_logprobs=prompt_logprobs)

    def _prompt_logprobs(self, ids: list[int], logits: Any, k: int) -> list[dict[int, Logprob] | None]:
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
        decode = self.tokenizer.decode if self.tokenizer is not None else lambda ids: None
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
            position = {token: Logprob(values[i], ranks[i], decode([token]))}
            for rank, (tok, lp) in enumerate(zip(*tops[i], strict=True) if k else (), 1):
                position.setdefault(tok, Logprob(lp, rank, decode([tok])))
            out.append(position)
        return out

    def _completion(self, index: int, sample: Any, params: SamplingParams) -> CompletionOutput:
        """One sample (a response, or one of its n samples) as vLLM's CompletionOutput."""
        tokens = list(sample.output_ids)
        reason = _FINISH.get(sample.finish_reason.label, sample.finish_reason.label)
        text = self._decode(tokens, params)
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        cut = (text_through_stop if params.include_stop_str_in_output else text_before_stop)(text, stops)
        if cut is not None:
            text, reason = cut, "stop"
        chosen = sample.output_log_probs
        if params.logprobs is None or chosen is None:
            return CompletionOutput(index, text, tokens, reason, error=getattr(sample, "error", None) or None)
        tops = sample.output_top_log_probs or [[] for _ in tokens]
        logprobs = [
            self._position(token, lp, top, params.logprobs)
            for token, lp, top in zip(tokens, chosen, tops, strict=False)
        ]
        return CompletionOutput(index, text, tokens, reason, logprobs, float(sum(chosen)))

    def _decode(self, tokens: list[int], params: SamplingParams) -> str:
        """The text of ``tokens``: special tokens skipped (bm's tokenizers do), or written as the
        checkpoint's tokenizer spells them with ``skip_special_tokens=False`` (checked when the
        request was built: only a checkpoint's tokenizer can)."""
        if self.tokenizer is None:
            return ""
        if params.skip_special_tokens:
            return self.tokenizer.decode(tokens)
        return self.get_tokenizer().decode(tokens, skip_special_tokens=False)

    def _position(
        self, token: int, logprob: float, top: list[tuple[int, float]], k: int
    ) -> dict[int, Logprob]:
        """One position's log probs in vLLM's shape: the chosen token first (its rank known when it is
        among the top ones the engine returned), then the ``k`` most likely."""
        decode = self.tokenizer.decode if self.tokenizer is not None else lambda ids: None
        ranks = {int(t): r for r, (t, _lp) in enumerate(top, 1)}
        out = {token: Logprob(logprob, ranks.get(token), decode([token]))}
        for rank, (tok, lp) in enumerate(top[:k], 1):
            out.setdefault(int(tok), Logprob(lp, rank, decode([int(tok)])))
        return out


@contextmanager
def _progress(show: bool, total: int) -> Iterator[Callable[[], None]]:
    """A progress bar on stderr while a batch runs (rich, a dependency already), when stderr is a
    terminal; nothing otherwise."""
    if not show:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    if not console.is_terminal:  # a log file gets no bar frames
        yield lambda: None
        return
    columns = (TextColumn("bm.LLM"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("requests", total=total)
        yield lambda: bar.advance(task)


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


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(t, int) for t in value)
        and bool(value)
    )


def _ids(value: Any) -> list[int]:
    try:
        ids = token_id_list(value)
    except RequestError as exc:
        raise InvalidParameterError(f"prompt: {exc}") from None
    if not ids:
        raise InvalidParameterError(
            "a prompt must be text or a non-empty list of token ids, got an empty list"
        )
    return ids


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if not all(isinstance(p, SamplingParams) for p in params):
        raise InvalidParameterError("sampling_params: expected bm.SamplingParams, or a list of them")
    if len(params) != count:
        raise InvalidParameterError(
            f"sampling_params: {len(params)} given for {count} prompts; give one, or one per prompt"
        )
    return params
