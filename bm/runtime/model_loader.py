"""Build the model with transformers from a checkpoint, a config file, or the embedded default.

Nothing here touches the network: checkpoints load with ``local_files_only``, and configs build random
weights from a seed (like vLLM's dummy load format), which is what benchmarking needs. Those are drawn
on the model's own device, once each (:func:`random_model`, bm.runtime.random_weights).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from bm.config import ModelConfig, resolve_dtype_name
from bm.config.model import BF16_WITHOUT_CPU_SUPPORT
from bm.cpu_isa import ENV_ISA, cpu_bf16_gemm, cpu_features, native_bf16
from bm.preset_files import gguf_path, preset_gguf
from bm.runtime.attention import probe_kv_shapes
from bm.runtime.default_model import TINY_LLAMA_CONFIG
from bm.runtime.fused_projections import fuse_projections, should_fuse_projections
from bm.runtime.fusion import fuse_elementwise, should_fuse
from bm.runtime.kv_quant import checkpoint_kv_scales, row_bytes
from bm.runtime.model_families import adapt_attention_modules
from bm.runtime.native import bf16_gemm_kernel, kv_cache_dtype
from bm.runtime.prepack import prepack_linears, should_prepack
from bm.runtime.random_weights import random_model
from bm.runtime.stored_checkpoints import load_stored_checkpoint
from bm.runtime.tokenizer import ByteTokenizer, HFTokenizer, TextCodec
from bm.runtime.weight_quant import WeightQuantError, quantize_linears
from bm.runtime.weight_sources import stored_quantization, weight_source

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

log = logging.getLogger("bm")


class ModelLoadError(ValueError):
    """The model could not be built; the message says which setting to change."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: TextCodec | None
    device: torch.device
    dtype: torch.dtype
    name: str
    vocab_size: int
    max_position_embeddings: int | None
    eos_token_id: int | None
    kv_shapes: dict[int, tuple[int, int]]  # layer_idx -> (kv_heads, head_dim), as measured
    sliding_window: int | None
    # False when only some layers slide (e.g. Qwen2's max_window_layers): one window cannot serve all.
    sliding_window_on_every_layer: bool = True
    # The model's own window per layer index (None: full attention), from its layer_types.
    layer_windows: tuple[int | None, ...] = ()
    # Linear layers running with oneDNN-packed weights on small batches (bm.runtime.prepack).
    num_prepacked_linears: int = 0
    # model.quantization as it ran (none, int8, fp8, gguf, gptq, awq: auto resolved, bm.runtime.weight_sources)
    # and the linears it took over: quantized on load, or given their stored format.
    quantization: str = "none"
    num_quantized_linears: int = 0
    # The GEMM of bf16 CPU linears (model.cpu_bf16_gemm resolved: onednn, invariant); None elsewhere.
    cpu_bf16_gemm: str | None = None
    # Modules (RMSNorm, gated MLP) and modeling functions (rotary) running bm's fused elementwise kernels.
    fused_elementwise: dict[str, int] = field(default_factory=dict)
    # Attention modules (qkv) and MLPs (gate_up) whose projections run as one GEMM (bm.runtime.fused_projections).
    fused_projections: dict[str, int] = field(default_factory=dict)
    # model.cuda_graphs: auto, on, off (decode-only steps replaying CUDA graphs; bm.runtime.triton.graphs)
    cuda_graphs: str = "auto"
    # model.warmup: auto, on, off (shape classes run when an engine is built; bm.runtime.warmup)
    warmup: str = "auto"
    # model.yield_cores: auto, on, off (fewer CPU threads while other processes hold cores)
    yield_cores: str = "auto"
    # per layer, the fp8 KV cache's key and value scales the checkpoint carries (bm.runtime.kv_quant)
    kv_scales: dict[int, tuple[float, float]] = field(default_factory=dict)
    # seconds load_model took (start-up, reported apart from a run's measured time)
    load_seconds: float | None = None
    # the executor engines over this model take in turn (bm.runtime.executor.executor_for); a copy made
    # with dataclasses.replace starts without one
    shared_executor: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def device_type(self) -> str:
        """cpu or cuda: which device's engine defaults a run on this model resolves (bm.config)."""
        return self.device.type

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype (bm.runtime.native.kv_cache_dtype: for a bf16 model on the CPU, bf16
        where the AVX-512 attention kernels read it, else float32)."""
        return kv_cache_dtype(self.device, self.dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token across all layers, in the model's own KV dtype."""
        return self.kv_cache_bytes_per_token("auto")

    def kv_cache_bytes_per_token(self, cache_dtype: str) -> int:
        """Keys and values of one token across all layers as a cache of ``kv_cache.dtype`` stores them
        (int8: each row's values and its scale; fp8_e4m3: a byte a value; bm.runtime.kv_quant)."""
        return sum(
            2 * heads * row_bytes(dim, self.kv_dtype, cache_dtype) for heads, dim in self.kv_shapes.values()
        )


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when present. A bare ``cuda`` under several ranks is this rank's own GPU
    (``cuda:LOCAL_RANK``, as torchrun and bm's own launcher set it), so ranks never share ``cuda:0``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"model.device is {name!r} but CUDA is not available here; use cpu or auto")
    if device.type == "cuda" and device.index is None:
        from bm.parallel.layout import local_cuda_index

        device = torch.device("cuda", local_cuda_index())
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype of ``model.dtype`` on ``device``, as :func:`bm.config.resolve_dtype_name` names it
    (the simulator resolves with it too), knowing this machine's CPU: bfloat16 on a CPU without bf16
    instructions runs in float32, said in one line. float32 asked for on CUDA runs its matmuls in TF32,
    as vLLM does."""
    native = native_bf16(cpu_features()) if device.type == "cpu" else None
    resolved = resolve_dtype_name(name, device.type, native)
    if resolved != resolve_dtype_name(name, device.type):
        log.warning("bm: %s", BF16_WITHOUT_CPU_SUPPORT)
    dtype = DTYPES[resolved]
    if dtype == torch.float32 and device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 (global to the process, like the device)
    return dtype


def load_model(cfg: ModelConfig) -> LoadedModel:
    from bm.hub_cache import is_hub_id

    started = time.perf_counter()
    hub_id = cfg.path if cfg.path and is_hub_id(cfg.path) else None  # the model's name, not its snapshot
    user_gguf = gguf_path(cfg.path)  # --model x.gguf: the file names the model, its conversion is a cache
    gguf = preset_gguf(cfg.preset) or user_gguf
    cfg = _resolved(cfg)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    stored = tp_kwargs = None
    if cfg.path:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model.path {cfg.path!r} is not a checkpoint directory (no config.json)")
        try:
            stored = stored_quantization(path)
        except WeightQuantError as exc:
            raise ModelLoadError(str(exc)) from None
        try:
            tp_kwargs = _tensor_parallel_kwargs(path)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"model.path {cfg.path!r} could not be loaded: {exc}") from exc
    # Resolved before the weights load (a refusal costs nothing), and by the layout: with several
    # replicas the shards are split after the load (_shard_replica), and are shards all the same.
    try:
        scheme, install = weight_source(
            cfg.quantization, device=device, dtype=dtype, sharded=cfg.path is not None and _tensor_parallel(),
            gguf=gguf, checkpoint=Path(cfg.path) if cfg.path else None, stored=stored,
        )  # fmt: skip
    except WeightQuantError as exc:
        raise ModelLoadError(str(exc)) from None
    if cfg.path:
        try:
            load = AutoModelForCausalLM.from_pretrained if stored is None else load_stored_checkpoint
            model = load(path, dtype=dtype, local_files_only=True, **tp_kwargs)
            model = _shard_replica(model, tp_kwargs)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"model.path {cfg.path!r} could not be loaded: {exc}") from exc
        name = hub_id or str(user_gguf or path)
    else:
        if cfg.config:
            hf_config = _config_from_file(cfg.config)
            name = str(cfg.config)
        else:
            hf_config = AutoConfig.for_model(**TINY_LLAMA_CONFIG)
            name = "embedded tiny-llama"
        model = random_model(hf_config, dtype, device, cfg.seed)
    model.to(device).eval()
    tokenizer = load_tokenizer(cfg)  # after the model: a checkpoint that is not one is named first
    loaded = describe_model(
        model,
        tokenizer,
        name,
        prepack=cfg.prepack,
        cpu_bf16_gemm=cfg.cpu_bf16_gemm,
        fused_elementwise=cfg.fused_elementwise,
        fused_projections=cfg.fused_projections,
        quantization=scheme,
        install_weights=install,
    )
    loaded.cuda_graphs = cfg.cuda_graphs
    loaded.warmup = cfg.warmup
    loaded.yield_cores = cfg.yield_cores
    if cfg.path:
        loaded.kv_scales = checkpoint_kv_scales(Path(cfg.path))
    loaded.load_seconds = time.perf_counter() - started
    return loaded


def load_tokenizer(cfg: ModelConfig) -> TextCodec | None:
    """The tokenizer :func:`load_model` gives the model of ``cfg``, without loading the model: a process
    that only decodes tokens (``bm run --ray``'s driver, writing ``batch_output.jsonl``'s logprobs) names
    them as the replicas' model does. A checkpoint's own (or ``model.tokenizer``), none if it has none;
    the embedded model's byte tokenizer; a random-weight ``model.config`` has only ``model.tokenizer``."""
    cfg = _resolved(cfg)
    if cfg.path:
        return _try_tokenizer(cfg.tokenizer or str(cfg.path))
    if cfg.tokenizer:
        return _try_tokenizer(cfg.tokenizer, required=True)
    return None if cfg.has_no_tokenizer else ByteTokenizer()


def resolve_cpu_bf16_gemm(requested: str, prepack: str = "auto") -> str:
    """``model.cpu_bf16_gemm`` for a bf16 model on this machine's CPU: onednn or invariant, as
    :func:`bm.cpu_isa.cpu_bf16_gemm` decides from the CPU's features and ``BM_CPU_ISA`` (config
    validation refused an impossible invariant already; a model described without a config is refused
    here, ``prepack`` off included). What only loading can tell: ``auto`` keeps oneDNN where the kernel
    did not build (no compiler, ``BM_NATIVE_KERNELS=0``); ``invariant`` is refused there."""
    try:
        choice = cpu_bf16_gemm(
            requested, cpu_features(), platform.machine(), os.environ.get(ENV_ISA), prepack
        )
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    if choice == "onednn" or bf16_gemm_kernel() is not None:
        return choice
    if requested == "invariant":
        raise ModelLoadError(
            "model.cpu_bf16_gemm: invariant, but bm's bf16 GEMM could not be built here "
            "(BM_NATIVE_KERNELS=0, or no C compiler)"
        )
    return "onednn"


def _resolved(cfg: ModelConfig) -> ModelConfig:
    """A named model (``model.preset``) or a GGUF file in ``model.path`` as the checkpoint converted from
    it once (bm/runtime/presets.py); a hub id in
    ``model.path`` or ``model.tokenizer`` as its snapshot in the local Hugging Face cache
    (bm.hub_cache), so ``bm.LLM("org/name")`` loads what ``bm run --model org/name`` does."""
    from dataclasses import replace

    from bm.hub_cache import local_dir

    if cfg.path or cfg.tokenizer:
        cfg = replace(
            cfg,
            path=local_dir(cfg.path) if cfg.path else cfg.path,
            tokenizer=local_dir(cfg.tokenizer) if cfg.tokenizer else cfg.tokenizer,
        )
    if cfg.path and gguf_path(cfg.path):
        from bm.runtime.presets import PresetError, converted_gguf

        try:
            return replace(cfg, path=str(converted_gguf(Path(cfg.path), Path(cfg.path).stem.lower())))
        except PresetError as exc:
            raise ModelLoadError(str(exc)) from None
    if cfg.preset is None:
        return cfg
    from bm.runtime.presets import PresetError, resolve_preset

    try:
        return resolve_preset(cfg)
    except PresetError as exc:
        raise ModelLoadError(str(exc)) from None


def _tensor_parallel_kwargs(path: Path) -> dict[str, Any]:
    """Under ``--tensor-parallel N`` each rank loads only its shard, by the model's own tp_plan."""
    from bm.parallel.layout import current_layout
    from bm.parallel.tensor_parallel import TensorParallelError, distributed_config

    layout = current_layout()
    if layout.tensor_parallel == 1:
        return {}
    try:
        config = distributed_config(path, layout)
    except TensorParallelError as exc:
        raise ModelLoadError(str(exc)) from None
    return {} if config is None else {"distributed_config": config}


def _tensor_parallel() -> bool:
    """Whether this process holds a tensor-parallel shard of the model (loaded so, or split after)."""
    from bm.parallel.layout import current_layout

    return current_layout().tensor_parallel > 1


def _shard_replica(model: torch.nn.Module, tp_kwargs: dict[str, Any]) -> torch.nn.Module:
    """With several replicas, the shards are split after loading (see bm.parallel.tensor_parallel)."""
    from bm.parallel.layout import current_layout
    from bm.parallel.tensor_parallel import shard_replica

    layout = current_layout()
    return model if layout.tensor_parallel == 1 or tp_kwargs else shard_replica(model, layout)


def _config_from_file(path_text: str) -> PretrainedConfig:
    path = Path(path_text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"model.config {path_text!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"model.config {path_text!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelLoadError(f"model.config {path_text!r} needs a 'model_type' (e.g. \"llama\")")
    try:
        return AutoConfig.for_model(**data)
    except ValueError as exc:
        raise ModelLoadError(f"model.config {path_text!r}: {exc}") from None


def _try_tokenizer(path: str, required: bool = False) -> TextCodec | None:
    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError, TypeError) as exc:
        if required:
            raise ModelLoadError(f"model.tokenizer {path!r} could not be loaded: {exc}") from exc
        return None


def describe_model(
    model: torch.nn.Module,
    tokenizer: TextCodec | None,
    name: str,
    prepack: str = "auto",
    fused_elementwise: str = "auto",
    fused_projections: str = "auto",
    cpu_bf16_gemm: str = "auto",
    quantization: str = "none",
    install_weights: Callable[[torch.nn.Module], int] | None = None,
) -> LoadedModel:
    """What bm needs to know of a built model; probes its attention layers (and takes them over).

    ``prepack`` (auto, on, off): give the linear layers oneDNN-packed weights for small batches
    (bm.runtime.prepack). It happens here, at load, so the KV cache is sized from the memory left after.
    ``cpu_bf16_gemm`` (auto, onednn, invariant): the kernel a bf16 CPU model's linears are packed for
    (:func:`resolve_cpu_bf16_gemm`); invariant packs them whatever ``prepack`` auto's memory check says.
    ``fused_elementwise`` (auto, on, off): run RMSNorm, rotary and SiLU-mul as single passes inside bm
    forwards, C on CPU and Triton on CUDA (bm.runtime.fusion).
    ``fused_projections`` (auto, on, off): q/k/v and gate/up as one GEMM each inside bm forwards, on CUDA
    in 16-bit dtypes (bm.runtime.fused_projections); after the elementwise fusion, whose MLPs it extends.
    ``quantization`` (none, int8, fp8, gguf, gptq, awq), as bm.runtime.weight_sources resolved it, with the
    ``install_weights`` it gave: the decoder's linears quantized, or given their stored format, first,
    so nothing packs their full-width weights. Without ``install_weights``, ``quantization`` none or
    int8 (quantized on load).
    """
    config: Any = model.config.get_text_config()
    param = next(model.parameters())
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None)
    if sliding is not None and not getattr(config, "use_sliding_window", True):
        sliding = None
    if layer_types and "sliding_attention" not in layer_types:
        sliding = None
    adapt_attention_modules(model)
    kv_shapes = probe_kv_shapes(model)
    try:
        num_quantized = install_weights(model) if install_weights else quantize_linears(model, quantization)
    except WeightQuantError as exc:
        raise ModelLoadError(str(exc)) from exc
    num_packed = 0
    bf16_gemm = None
    if param.device.type == "cpu" and param.dtype == torch.bfloat16:
        bf16_gemm = resolve_cpu_bf16_gemm(cpu_bf16_gemm, prepack)
    if bf16_gemm == "invariant" or should_prepack(prepack, model, param.device, param.dtype):
        num_packed = prepack_linears(model, bf16_gemm or "onednn")
    fused = {}
    if should_fuse(fused_elementwise, param.device, param.dtype):
        fused = fuse_elementwise(model)
    stacked = {}
    if should_fuse_projections(fused_projections, param.device, param.dtype):
        stacked = fuse_projections(model)
    num_layers = max(kv_shapes) + 1
    if layer_types:
        windows = tuple(sliding if t == "sliding_attention" else None for t in layer_types[:num_layers])
        windows += (None,) * (num_layers - len(windows))
    else:
        windows = (sliding,) * num_layers
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=param.device,
        dtype=param.dtype,
        name=name,
        vocab_size=config.vocab_size,
        max_position_embeddings=getattr(config, "max_position_embeddings", None),
        eos_token_id=eos,
        kv_shapes=kv_shapes,
        sliding_window=sliding,
        sliding_window_on_every_layer=all(t == "sliding_attention" for t in layer_types),
        layer_windows=windows,
        num_prepacked_linears=num_packed,
        quantization=quantization,
        num_quantized_linears=num_quantized,
        cpu_bf16_gemm=bf16_gemm,
        fused_elementwise=fused,
        fused_projections=stacked,
    )


def available_memory_bytes(device: torch.device) -> int:
    """Memory free for the KV cache now: device memory on CUDA, available system memory on CPU.

    On CUDA the driver's free memory does not count what torch's caching allocator holds without using
    (a previous engine's cache, freed but kept reserved): counted here, a second engine in one process
    (a ``bm compare`` variant, a sweep point, a second ``bm.LLM``) sees the memory the first one saw."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free) + max(0, int(cached))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
