"""Where a model and its tokenizer meet: the one loader every command and ``bm.LLM`` load a model through,
which refuses a tokenizer whose ids the model has no embedding for.

A random-weight model config with a checkpoint's tokenizer (``--model-config 15m.json --set
model.tokenizer=smollm2``: 49,152 ids against a vocabulary of 8,192) used to load, and each prompt was
then refused on its own row (``token id 19556 is outside the vocabulary``): 23 of 24 rows failed, the run
exited 0 and printed a throughput table for the one request that ran. The mismatch is the model's, not a
row's, so it is refused once, before anything runs, naming both sizes and the fix.

Plain Python at import (the runtime is imported when a model is loaded), so the check itself is tested
without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bm.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from bm.runtime import LoadedModel


def load_fitting_model(cfg: ModelConfig) -> LoadedModel:
    """The model of ``cfg`` (:func:`bm.runtime.load_model`), refused with :class:`ConfigError` when its
    tokenizer can produce ids past its vocabulary (:func:`check_tokenizer_fits`)."""
    from bm.runtime import load_model

    loaded = load_model(cfg)
    check_tokenizer_fits(loaded.tokenizer, loaded.vocab_size, cfg, loaded.name)
    return loaded


def tokenizer_size(tokenizer: Any) -> int | None:
    """How many ids ``tokenizer``'s own vocabulary spans (a transformers tokenizer's ``vocab_size``,
    added tokens aside; the byte tokenizer's 259), or None when it does not say.

    Added tokens are left out on purpose: a checkpoint may add a pad token past its embedding that no
    prompt holds; any text encodes into the base vocabulary, so that is what must fit."""
    if tokenizer is None:
        return None
    size = getattr(getattr(tokenizer, "tokenizer", tokenizer), "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def check_tokenizer_fits(tokenizer: Any, vocab_size: int, cfg: ModelConfig, model_name: str) -> None:
    """Raise :class:`ConfigError` when ``tokenizer`` has more ids than the model's ``vocab_size``: every
    text would risk ids the model has no embedding for. A smaller tokenizer is fine (vocabularies are
    often padded to a round size)."""
    size = tokenizer_size(tokenizer)
    if size is None or size <= vocab_size:
        return
    if cfg.tokenizer:
        source = f"model.tokenizer {cfg.tokenizer!r}"
        fix = (
            f"give the tokenizer made for this model (--set model.tokenizer=DIR), or a model whose "
            f"vocab_size is at least {size:,}"
        )
    else:
        source = f"the tokenizer of {model_name}"
        fix = (
            "the checkpoint's tokenizer and config.json disagree: give the tokenizer made for it with "
            "--set model.tokenizer=DIR"
        )
    raise ConfigError(
        f"{source} has {size:,} token ids, but the model ({model_name}) has a vocabulary of "
        f"{vocab_size:,}: prompts would hold ids it has no embedding for; {fix}"
    )
