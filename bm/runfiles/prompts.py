"""From a row (a checked request line) to the batch manager's request, once the model (and tokenizer) is loaded.

The file itself is read by :mod:`bm.workloads.jsonl` (or :mod:`bm.runfiles.openai_batch`) before the model
loads, so a bad file is reported at once; here text is tokenized, chats are rendered with the chat
template and word lists become token ids; the engine checks ids against the vocabulary. Every line keeps
its place: the batch manager gets each line's 0-based number as its request id (always unique), and the user's
``id`` is echoed back in the output record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bm.engine.requests.request import Request
from bm.engine.requests.seeds import line_seed
from bm.engine.requests.validate import check_prompt_length
from bm.runfiles.records import in_line_terms
from bm.runtime.tokenizer import ChatTemplateError, chat_renderer
from bm.workloads.jsonl import (
    WORD_LISTS,
    chat_ids,
    check_without_tokenizer,
    read_request_file,
    resolve_word_list,
)
from bm.workloads.request import Row, RowError
from bm.workloads.tool_parsers import detect_parser, line_parser


@dataclass
class Codec:
    """What building requests needs of the model: its tokenizer (if any) and chat template."""

    encode: Callable[[str], list[int]] | None = None
    encode_word: Callable[[str], list[int]] | None = None
    render_chat: Callable[..., list[int]] | None = None  # (messages, tools=None) -> ids
    chat_template: str | None = None  # the Jinja text render_chat uses (None: unknown or none)
    # The parser for replies to lines with tools and tool_choice auto: the run's --tool-call-parser, else
    # the one the chat template's call syntax gives away, else None (such a line gets an error).
    tool_parser: str | None = None
    # The most tokens a prompt of this model can have (its max_position_embeddings; engine.max_seq_len may
    # lower it, which the engine checks): a text far longer is refused from a prefix, not tokenized whole.
    max_prompt_tokens: int | None = None
    # The longest sequence a request may reach (engine.max_seq_len, else the model's own): where a line
    # whose format has no default length (OpenAI's) stops when no end token comes first.
    max_seq_len: int | None = None


def codec_for(
    loaded: Any,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
    engine_max_seq_len: int | None = None,
) -> Codec:
    """The :class:`Codec` of a loaded model; ``chat_template`` (Jinja text) overrides the checkpoint's,
    ``tool_call_parser`` (a checked name) the parser detected from it; ``engine_max_seq_len`` (the
    config's ``engine.max_seq_len``) lowers the model's own length limit."""
    tokenizer = loaded.tokenizer
    limits = [x for x in (engine_max_seq_len, loaded.max_position_embeddings) if x]
    longest = min(limits) if limits else None
    if tokenizer is None:
        return Codec(
            tool_parser=tool_call_parser,
            max_prompt_tokens=loaded.max_position_embeddings,
            max_seq_len=longest,
        )
    render = chat_renderer(tokenizer, chat_template)

    def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        try:
            return render(messages, tools=tools) if tools else render(messages)
        except ChatTemplateError as exc:
            raise RowError(str(exc)) from None

    template = chat_template or getattr(tokenizer, "chat_template", None)
    return Codec(
        tokenizer.encode,
        tokenizer.encode_word,
        render_chat if render is not None else None,
        chat_template=template,
        tool_parser=tool_call_parser or detect_parser(template),
        max_prompt_tokens=loaded.max_position_embeddings,
        max_seq_len=longest,
    )


# A line's prompt p > 0 (an OpenAI completions prompt list) runs as request ``index + p * PART_ID_STRIDE``:
# every id stays unique whatever the file's length, and the line's own prompt keeps its index as its id.
PART_ID_STRIDE = 1 << 40


def to_requests(
    row: Row,
    codec: Codec,
    default_max_tokens: int,
    default_end_id: int | None,
    run_seed: int | None = None,
) -> list[tuple[Row, Request]] | None:
    """Every request a row runs as, each with the row it answers: one, or one per prompt of an OpenAI
    completions prompt list (``row.more_prompts``), whose records :class:`bm.runfiles.records.LineParts`
    joins into the line's one. None when the line cannot run (the row carries the first part's error)."""
    if not row.more_prompts:
        request = to_request(row, codec, default_max_tokens, default_end_id, run_seed)
        return None if request is None else [(row, request)]
    rows = [row] + [_part_row(row, prompt) for prompt in row.more_prompts]
    out = []
    for p, part in enumerate(rows):
        part.part, part.num_parts = p, len(rows)
        request = to_request(
            part, codec, default_max_tokens, default_end_id, run_seed, row.index + p * PART_ID_STRIDE
        )
        if request is None:
            row.error = part.error
            return None
        out.append((part, request))
    return out


def _part_row(row: Row, prompt: Any) -> Row:
    """The row of one more prompt of ``row``'s list: its fields, its own prompt."""
    from dataclasses import replace

    text = prompt if isinstance(prompt, str) else None
    ids = None if text is not None else list(prompt)
    return replace(row, prompt=text, input_ids=ids, more_prompts=None, fields=dict(row.fields))


def to_request(
    row: Row,
    codec: Codec,
    default_max_tokens: int,
    default_end_id: int | None,
    run_seed: int | None = None,
    request_id: int | None = None,
) -> Request | None:
    """The core request for one row, tokenized; None when it cannot become one (the row then carries its
    error). Its request id is the row's index, the line's 0-based number in the file, so a blank line
    never shifts the indexes of the lines after it (``request_id``: another, for a line's later prompts). Records the prompt's length on the row.

    With ``run_seed``, a line without a ``seed`` samples with one derived from the run seed and its
    index (:func:`bm.engine.requests.seeds.line_seed`): duplicate lines differ, and the run seed reproduces
    the run. A line's own seed stays exact."""
    if row.error is not None:
        return None
    request_id = row.index if request_id is None else request_id
    try:
        if codec.encode is None:  # what the line gives as text cannot run: refused naming the fix
            check_without_tokenizer(row)
        prompt_ids = _prompt_ids(row, codec)
        fields: dict[str, Any] = dict(row.fields)
        for name in WORD_LISTS:
            if name in fields:
                fields[name] = resolve_word_list(fields[name], name, codec.encode_word)
        if row.stop:
            stops = resolve_word_list(row.stop, "stop", codec.encode_word)
            fields["stop_words_list"] = [*fields.get("stop_words_list", []), *stops]
        if "end_id" not in fields and default_end_id is not None:
            fields["end_id"] = default_end_id
        if run_seed is not None:
            fields.setdefault("random_seed", line_seed(run_seed, request_id))
        if row.lora_dir is not None:
            _add_lora_dir(fields, row.lora_dir)
        if row.tool_auto:
            row.tool_parser = line_parser(codec.chat_template, codec.tool_parser)
    except RowError as exc:
        row.error = f"{row.where}: {in_line_terms(str(exc), row)}"
        return None
    # A file's records are written when each request finishes: streaming changes nothing there, and
    # with it off every response the engine sends is the request's one final response.
    fields.pop("streaming", None)
    row.num_prompt_tokens = len(prompt_ids)
    max_tokens = row.max_tokens or default_max_tokens
    if row.max_tokens is None and row.max_tokens_to_limit and codec.max_seq_len is not None:
        # OpenAI's default: no cap of the run's own; the end token or the model's length ends it
        max_tokens = max(codec.max_seq_len - len(prompt_ids), 1)
    # Typed values as parsed. Ranges that depend on the model (token ids against the vocabulary, where ids
    # from vocab_size on may be prompt-table rows; a bias per vocabulary token) are the engine's
    # validate_request's alone: a second check here is how prompt tuning through `bm run` broke.
    return Request(request_id, input_ids=list(prompt_ids), request_output_len=max_tokens, **fields)


def read_prompt_lines(
    path: Path,
    encode: Callable[[str], list[int]] | None,
    default_max_tokens: int,
    default_end_id: int | None,
    encode_word: Callable[[str], list[int]] | None = None,
) -> list[tuple[Row, Request | None]]:
    """Each row of a file with its request, without a loaded model (the engine checks ids against its
    vocabulary)."""
    codec = Codec(encode=encode, encode_word=encode_word)
    return [
        (row, to_request(row, codec, default_max_tokens, default_end_id)) for row in read_request_file(path)
    ]


def _add_lora_dir(fields: dict[str, Any], directory: str) -> None:
    """A PEFT adapter directory as the seed's fields, read through the library (bm.adapters); the task
    id derives from the directory unless the line gives ``lora_task_id``. Every line carries the
    weights, so no line depends on another's."""
    from bm.adapters import lora_fields

    try:
        adapter = lora_fields(directory)
    except ValueError as exc:
        raise RowError(str(exc)) from None
    fields["lora_config"], fields["lora_weights"] = adapter["lora_config"], adapter["lora_weights"]
    fields.setdefault("lora_task_id", adapter["lora_task_id"])


def _prompt_ids(entry: Row, codec: Codec) -> list[int]:
    if entry.input_ids is not None:
        return entry.input_ids
    if entry.messages is not None:
        return chat_ids(entry, codec.render_chat)
    # a tokenizer: to_request refused a text prompt without one
    ids = _encode_prompt(codec.encode, entry.prompt or "", codec.max_prompt_tokens)
    if not ids:
        raise RowError("prompt: the prompt encodes to no tokens")
    return ids


# A prefix of a long text is tokenized first, this many characters per token the model takes: ordinary text
# is 3 to 5, so the prefix alone is over the maximum and the rest is never tokenized.
PREFIX_CHARS_PER_TOKEN = 8
# How many more tokens a prefix cut mid-text may count than the same stretch of the whole text: the cut
# (made at a space where one is near) changes the tokens at it, never more than a few.
CUT_SLACK = 64


def _encode_prompt(encode: Callable[[str], list[int]], text: str, limit: int | None) -> list[int]:
    """The tokens of ``text``; a text too long for ``limit`` tokens is refused from a prefix, whose count
    less CUT_SLACK the whole text's can not be under. A text can have far fewer tokens than characters
    (runs of spaces, repeated words), so a prefix under the limit proves nothing: it doubles until it is
    over, or is the whole text. A 50 MB line was tokenized whole to be refused: 71 s and 5.4 GB with
    SmolLM2's tokenizer, now 0.05 s."""
    if limit is not None:
        size = PREFIX_CHARS_PER_TOKEN * limit
        while size < len(text):
            cut = max(text.rfind(" ", size // 2, size), text.rfind("\n", size // 2, size))
            prefix = text[: cut if cut > 0 else size]
            check_prompt_length(
                len(encode(prefix)) - CUT_SLACK, limit, "its max_position_embeddings", at_least=True
            )
            size *= 2
    return encode(text)
