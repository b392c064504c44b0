"""Random-weight models built where they run: each parameter drawn once, seeded, on the target device.

Building from a config the plain way (``AutoModelForCausalLM.from_config`` on the CPU, then ``.to(device)``)
draws every weight twice on the CPU, once in torch's ``reset_parameters`` while the modules are built and
again in transformers' ``_init_weights``, about 23 ns a parameter on one core of an H100 machine: three
minutes for an 8B shape before the GPU sees a byte. :func:`random_model` does what ``from_pretrained``
does for weights a checkpoint lacks: build on the meta device (no memory, no draws), allocate on the
target device, mark the tied copies as initialized, let transformers' ``initialize_weights()`` draw the
rest once there (it also recomputes the non-persistent buffers, such as rotary ``inv_freq``), then tie.
The one exception to "once" is transformers' own: a few families' ``_init_weights`` write some weights
twice (Falcon's projections, GPT-2's ``c_proj``; tests/test_random_weights.py lists them), as their
``from_pretrained`` does too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

log = logging.getLogger("bm")


class IncompleteInitError(RuntimeError):
    """transformers' ``_init_weights`` left some parameters or buffers of a meta-built model unwritten."""


def random_model(
    hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device | str, seed: int
) -> torch.nn.Module:
    """A causal LM with seeded random weights, allocated and drawn on ``device`` (in train mode, as
    ``from_config`` returns it).

    The same seed on the same kind of device gives bitwise the same weights; CPU and CUDA draws differ,
    and so do draws from the plain ``from_config`` build (torch draws there first). The caller's random
    state is left as it was.

    An architecture whose meta build fails, or whose ``_init_weights`` leaves a parameter or buffer
    unwritten, is built again directly on ``device`` instead (each weight then drawn twice, still seeded
    and on the device), with a warning that says why. No family in tests/model_matrix.py needs that
    fallback (transformers 5.17 to 5.24): all take the meta path.
    """
    device = _concrete(torch.device(device))
    with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):
        try:
            torch.manual_seed(seed)
            return _build_on_meta(hf_config, dtype, device)
        except Exception as exc:  # any failure of the meta path is retried the plain way, which may raise
            log.warning(
                "random weights for %r: the meta-device build failed (%s: %s); building on %s directly",
                hf_config.model_type,
                type(exc).__name__,
                exc,
                device,
            )
        torch.manual_seed(seed)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)


def _build_on_meta(hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    # Under a meta default device, post_init skips initialize_weights() and only ties the weights.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    tied = dict(model.all_tied_weights_keys)  # {target: source}, e.g. lm_head.weight -> embed_tokens
    model.to_empty(device=device)  # new tensors for every parameter and buffer: the ties are undone
    for target in tied:  # overwritten by the tie, so never drawn (as from_pretrained marks them)
        model.get_parameter(target)._is_hf_initialized = True
    with _default_dtype(dtype):  # as from_config runs it: buffers computed in the default dtype match
        model.initialize_weights()
    model.tie_weights(recompute_mapping=False)
    # Every in-place write (normal_, fill_, copy_) bumps a tensor's version: one still at 0 was never
    # written, and holds whatever the allocator left there.
    unwritten = [
        name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor._version == 0
    ]
    if unwritten:
        raise IncompleteInitError(f"_init_weights left {', '.join(unwritten[:4])} unwritten")
    return model


def _concrete(device: torch.device) -> torch.device:
    """``cuda`` without an index is the current CUDA device (whose random state is the one drawn from)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` for a while, as ``from_config(dtype=...)`` sets it while it
    builds and initializes (GPT-J's sinusoidal positions, for one, are computed in it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
