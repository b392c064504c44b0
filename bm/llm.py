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

The defaults are vLLM's (``SamplingParams()`` samples at temperature 1.0, over the checkpoint's
``generation_config.json`` when ``generate`` is given no parameters), so a script written for vLLM gets
the kind of answer it got there; greedy is ``temperature=0``. Generation stops at the model's end token
unless ``ignore_eos`` is set (the seed's library default of end id -1 never stops, which surprises
everyone who did not ask for it). What a call takes is judged in :mod:`bm.llm_inputs` and
:mod:`bm.llm_chat`; what it returns is built in :mod:`bm.llm_outputs`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bm.config import BmConfig, resolve_engine
from bm.engine.requests.fields import RequestError
from bm.engine.requests.request import Request, Response
from bm.generation_config import generation_defaults
from bm.llm_config import build_config, check_tensor_parallel, library_options
from bm.llm_inputs import LoraRequests, Loras, parse_prompts, per_prompt_params, refuse_call_keywords
from bm.llm_outputs import OutputBuilder
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
from bm.llm_session import Session, progress
from bm.llm_types import (
    BeamSearchOutput,
    BeamSearchParams,
    LoRARequest,
    TextPrompt,
    TokensPrompt,
)

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "CompletionOutput",
    "GuidedDecodingParams",
    "InvalidParameterError",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "Session",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
]

Prompt = str | Sequence[int] | Mapping[str, Any]
Messages = list[dict[str, Any]]


class LLM:
    """A model loaded once, and generation over lists of prompts or chats.

    ``model``: a preset (``smollm2-135m``, ``tiny-random``), a local Hugging Face checkpoint directory, or
    a mapping of ``model`` section keys (``{"preset": "tiny-random", "seed": 3}``); ``model_config=PATH``
    builds the model from a config JSON with random weights (the CLI's ``--model-config``).
    ``config``: a YAML config file or a :class:`~bm.config.BmConfig`. Keywords: vLLM's engine arguments
    (``max_model_len``, ``gpu_memory_utilization``, ``dtype``, ``max_num_seqs``, ``enable_lora``,
    ``max_loras``, ``max_lora_rank``, ``generation_config``, ... mapped by
    :data:`bm.llm_config.ENGINE_ARGS`), keys of the ``model`` section (``device="cpu"``) and config
    sections as mappings (``engine={"max_batch_size": 64}``). ``seed`` seeds sampling, as in vLLM: each
    request without a seed of its own samples with one derived from it and the request's number (the
    random weights' seed is ``model={"seed": ...}``). Every value is checked at once, with the same
    messages as ``bm run --set``, and a bad one raises :class:`InvalidParameterError`.
    """

    def __init__(
        self,
        model: str | Mapping[str, Any] | None = None,
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
        self.options = library_options(options)
        config_ = build_config(model, config, options)
        self._defaults = generation_defaults(self.options.generation_config, config_.model.path)
        from bm.model_fit import load_fitting_model  # the runtime: once every keyword is judged

        self.seed = 0 if seed is None else seed  # vLLM V1 seeds with 0 when none is given
        self.loaded = load_fitting_model(config_.model)
        # the budgets left unset take the model's device's defaults (bm.config.resolve_engine), so what
        # this object reports is what its engines run
        self.config = resolve_engine(config_, self.loaded.device_type)
        self.tokenizer = self.loaded.tokenizer
        self._outputs = OutputBuilder(self.tokenizer)
        self._lora = LoraRequests(self.options.enable_lora, self.options.max_lora_rank)
        self._next_id = 0
        self._executor: Any = None  # one executor for every engine of this object: one cache, one warm-up
        self._prepare_engine()
        self._limits = self._request_limits()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Loras = None,
        **unknown: Any,
    ) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in order. A prompt is text, a list of token ids, or
        vLLM's ``TextPrompt``/``TokensPrompt`` dicts (mixed in one list); one ``SamplingParams`` serves
        every prompt, or give a list with one per prompt (none: :meth:`get_default_sampling_params`).
        ``lora_request``: one adapter for every prompt, or a list with one (or None) per prompt (needs
        ``LLM(enable_lora=True)``). Every request is validated before any runs; a bad one raises
        :class:`InvalidParameterError`. ``use_tqdm`` shows a progress bar on stderr while the batch runs."""
        refuse_call_keywords("LLM.generate", unknown)
        batch = parse_prompts(prompts, self._encode)
        params = per_prompt_params(sampling_params, len(batch), self.get_default_sampling_params)
        return self._generate(batch, params, self._lora.per_prompt(lora_request, len(batch)), use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Loras = None,
        chat_template: str | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **unknown: Any,
    ) -> list[RequestOutput]:
        """Generate replies to chats (OpenAI-style ``[{"role": ..., "content": ...}]`` turns), each rendered
        with the model's chat template (or ``chat_template``, Jinja text); ``RequestOutput.prompt`` is the
        rendered text. ``tools`` (OpenAI's function specs) and ``chat_template_kwargs`` are handed to the
        template; ``add_generation_prompt`` opens the assistant's turn, ``continue_final_message``
        continues the last message instead (vLLM's keywords and meanings)."""
        from bm.llm_chat import render_chat

        refuse_call_keywords("LLM.chat", unknown)
        chats = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        if tools is not None and (
            not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise InvalidParameterError(
                "tools: expected a list of tool objects, e.g. [{'type': 'function', ...}]"
            )
        options = {
            "chat_template": chat_template,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "chat_template_kwargs": chat_template_kwargs,
        }
        batch = [render_chat(self.tokenizer, list(chat), **options) for chat in chats]
        params = per_prompt_params(sampling_params, len(batch), self.get_default_sampling_params)
        return self._generate(batch, params, self._lora.per_prompt(lora_request, len(batch)), use_tqdm)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: Loras = None,
        use_tqdm: bool = False,
        **unknown: Any,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search, on bm's engine beam search: one :class:`BeamSearchOutput` per prompt with
        ``beam_width`` sequences, best first. ``engine.max_beam_width`` is raised to ``beam_width`` here
        when it is lower (the engines this object builds from then on take beams that wide). The beams
        equal HF ``generate(num_beams=beam_width, length_penalty=...)`` (``early_stopping=False``)."""
        refuse_call_keywords("LLM.beam_search", unknown)
        if not isinstance(params, BeamSearchParams):
            raise InvalidParameterError("LLM.beam_search(params=...): expected bm.BeamSearchParams(...)")
        if not params.skip_special_tokens and getattr(self.tokenizer, "tokenizer", None) is None:
            raise InvalidParameterError(
                "BeamSearchParams.skip_special_tokens: False writes special tokens as the tokenizer spells "
                "them, and this model's tokenizer (bm's byte tokenizer, or none) has no text for them"
            )
        batch = parse_prompts(prompts, self._encode)
        loras = self._lora.per_prompt(lora_request, len(batch))
        self._allow_beams(params.beam_width)
        fields_ = {
            "beam_width": params.beam_width,
            "len_penalty": float(params.length_penalty),
            "early_stopping": 0,
            "return_log_probs": True,
            "request_output_len": params.max_tokens,
        }
        end_id = None if params.ignore_eos else self.loaded.eos_token_id
        extras = [{**fields_, **self._lora.fields(lora)} for lora in loras]
        results, _ = self._run(batch, extras, [end_id] * len(batch), use_tqdm)
        return [
            self._outputs.beam_output(ids, params, result, end_id, lora)
            for (_text, ids), (result, _t), lora in zip(batch, results, loras, strict=True)
        ]

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate``/``chat`` use when given no ``SamplingParams``: vLLM's defaults, overridden by
        the checkpoint's ``generation_config.json`` (``temperature``, ``top_p``, ``top_k``, ``min_p``,
        ``repetition_penalty``, ``max_new_tokens`` as ``max_tokens``) unless ``LLM(generation_config=
        "vllm")``, or by the one in the directory ``generation_config`` names; as vLLM's ``LLM`` does."""
        return SamplingParams(**self._defaults)

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
        from bm.parallel.layout import current_layout

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
        from bm.engine.execution.protocol import ModelLimits
        from bm.engine.step.setup import request_limits

        executor = self._engine_executor()
        model = executor.limits if executor is not None else ModelLimits(
            vocab_size=self.loaded.vocab_size, max_position_embeddings=self.loaded.max_position_embeddings
        )  # fmt: skip
        return request_limits(self.config, model)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidParameterError("this model has no tokenizer; pass prompts as lists of token ids")
        if not isinstance(text, str):
            raise InvalidParameterError(f"prompt: expected text, got {type(text).__name__}")
        return self.tokenizer.encode(text)

    def _allow_beams(self, beam_width: int) -> None:
        """Raise ``engine.max_beam_width`` to ``beam_width``: a library call that asks for beams gets them,
        where a config file's bound is a choice its author made."""
        if beam_width <= self.config.engine.max_beam_width:
            return
        engine = dataclasses.replace(self.config.engine, max_beam_width=beam_width)
        self.config = dataclasses.replace(self.config, engine=engine)
        self._limits = self._request_limits()

    def _generate(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        loras: list[LoRARequest | None],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        extras, end_ids = [], []
        encode_word = getattr(self.tokenizer, "encode_word", None)
        for (_text, ids), p, lora in zip(prompts, params, loras, strict=True):
            fields_ = p.request_fields(encode_word)
            self._check_output_params(p)
            if "request_output_len" not in fields_:  # max_tokens=None: up to the model's length
                fields_["request_output_len"] = max(self._limits.max_seq_len - len(ids), 1)
            extras.append({**fields_, **self._lora.fields(lora)})
            end_ids.append(None if p.ignore_eos else self.loaded.eos_token_id)
        results, first = self._run(prompts, extras, end_ids, use_tqdm)
        return [
            self._outputs.request_output(first + i, text, ids, p, result, finished, lora)
            for i, ((text, ids), p, (result, finished), lora) in enumerate(
                zip(prompts, params, results, loras, strict=True)
            )
        ]

    def _requests(
        self,
        prompts: list[tuple[str | None, list[int]]],
        extras: list[dict[str, Any]],
        end_ids: list[Any],
        first: int,
    ) -> list[Request]:
        """One engine request per prompt, each checked by the engine's validator before any is sent."""
        from bm.engine.requests.seeds import line_seed
        from bm.engine.requests.validate import validate_request

        requests = []
        for i, ((_text, ids), fields_, end_id) in enumerate(zip(prompts, extras, end_ids, strict=True)):
            fields_ = dict(fields_)
            if "random_seed" not in fields_ and self.seed is not None:
                fields_["random_seed"] = line_seed(self.seed, first + i)
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
        extras: list[dict[str, Any]],
        end_ids: list[Any],
        use_tqdm: bool = False,
    ) -> tuple[list[tuple[Response, float | None]], int]:
        """Every request validated, then run as one batch: ``(final response, when it came back)`` per
        prompt in order, and the first request's number."""
        first = self._next_id
        requests = self._requests(prompts, extras, end_ids, first)
        self._next_id += len(prompts)
        results: dict[int, tuple[Response, float | None]] = {}
        with self.session() as session, progress(use_tqdm, len(requests)) as advance:
            for request in requests:
                session.submit(request)
            while len(results) < len(requests):
                response = session.next_final()
                if response is not None:
                    results[response.request_id] = (response, session.last_finished_at)
                    advance()
                elif not session.alive:
                    raise RuntimeError(f"the batch manager failed: {session.error}")
        for i, request in enumerate(requests):
            response = results[request.request_id][0]
            if (
                response.error
            ):  # refused when admitted (the cache cannot hold it, ...) or failed while running
                kind = RuntimeError if response.output_ids else InvalidParameterError
                raise kind(f"prompt {i}: {user_message(response.error)}")
        return [results[r.request_id] for r in requests], first
