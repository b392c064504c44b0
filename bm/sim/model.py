"""The shape of a decoder-only transformer, read from a Hugging Face ``config.json``: all the cost model
needs (no weights, no torch), so a simulated run of a 70B model needs only its config file."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bm.config import ConfigError
from bm.config.model import stored_scheme_mismatch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    name: str = ""
    torch_dtype: str | None = None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str = "") -> ModelShape:
        missing = [k for k in _REQUIRED if not isinstance(cfg.get(k), int) or cfg[k] <= 0]
        if missing:
            raise ConfigError(
                f"model config {name or '(dict)'}: field {missing[0]!r} is missing or not a positive integer; "
                "the simulator needs hidden_size, num_hidden_layers, num_attention_heads, "
                "intermediate_size and vocab_size (a Hugging Face config.json has them)"
            )
        heads = cfg["num_attention_heads"]
        return cls(
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            name=name,
            torch_dtype=cfg.get("torch_dtype") if cfg.get("torch_dtype") in DTYPE_BYTES else None,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelShape:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            cfg = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"--model-config {str(path)!r}: no such file; give a config.json") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--model-config {str(p)!r}: not JSON ({exc})") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"--model-config {str(p)!r}: expected a JSON object")
        return cls.from_dict(cfg, name=p.stem if p.name != "config.json" else p.parent.name)

    def shape_dict(self) -> dict[str, Any]:
        """The shape alone (no name): what a measured cost depends on."""
        out = dataclasses.asdict(self)
        out.pop("name")
        return out

    # -- counts ---------------------------------------------------------------------------------------

    @property
    def layer_linear_params(self) -> int:
        """Weights of one layer's GEMMs: q, k, v, o projections and a gated MLP (gate, up, down)."""
        h, d = self.hidden_size, self.head_dim
        attention = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        return attention + 3 * h * self.intermediate_size

    def layer_linears(self) -> list[tuple[int, int]]:
        """One layer's GEMMs as (outputs, inputs): q, k, v, o, gate, up, down."""
        h, q, kv, inter = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        return [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def num_params(self) -> int:
        """Linear layers, LM head and embedding (norms are negligible and left out)."""
        embed = 0 if self.tie_word_embeddings else self.hidden_size * self.vocab_size
        return self.num_layers * self.layer_linear_params + self.lm_head_params + embed

    def kv_bytes_per_token(self, dtype_bytes: int, cache_dtype: str = "auto") -> int:
        """K and V of every layer for one token: ``dtype_bytes`` an element, or with ``kv_cache.dtype:
        int8`` one byte an element and a four-byte scale a row, with ``fp8_e4m3`` one byte an element
        (bm.runtime.kv_quant's layouts)."""
        row = {"int8": self.head_dim + 4, "fp8_e4m3": self.head_dim}.get(
            cache_dtype, self.head_dim * dtype_bytes
        )
        return 2 * self.num_layers * self.num_kv_heads * row


@dataclass(frozen=True)
class WeightFormat:
    """How bm holds the decoder's linear weights (``model.quantization`` as it runs), in the bytes a
    forward reads: full width in the model's dtype (``bits`` None), or ``bits`` a weight plus
    ``group_bytes`` beside each group of ``group`` inputs of a row (None: one group a row). The output
    head and embeddings stay full width in every scheme (bm.runtime.weight_quant)."""

    name: str = "none"
    bits: int | None = None
    group: int | None = None
    group_bytes: int = 0

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def linear_bytes(self, shape: ModelShape, dtype_bytes: int) -> float:
        """Bytes of every decoder linear's weight (one read per forward)."""
        if self.bits is None:
            return float(shape.num_layers * shape.layer_linear_params * dtype_bytes)
        per_layer = sum(
            n * k * self.bits / 8 + n * (1 if self.group is None else k // self.group) * self.group_bytes
            for n, k in shape.layer_linears()
        )
        return shape.num_layers * per_layer


FULL_WIDTH = WeightFormat()
# int8 on load: a byte a weight and a float32 scale per output row (bm.runtime.weight_quant)
INT8 = WeightFormat("int8", 8, None, 4)
# A stored format as bm holds it (bm.runtime.native.GroupWeight): the values, then a float32 step and
# offset per group of a row
_GROUP_BYTES = 8
# FP8 on load: an e4m3 byte a weight, the row one group (bm.runtime.group_linears.fp8_rows)
FP8_ROWS = WeightFormat("fp8", 8, None, _GROUP_BYTES)


def weight_format(quantization: str, source: str | Path | None) -> WeightFormat:
    """The weights the simulator prices for ``model.quantization`` on the model whose config.json is
    ``source``: full width, int8 or FP8 on load, or the checkpoint's stored format (GPTQ and AWQ int4 in
    their group size, FP8 per block or per row), as the real loader resolves ``auto``. What it cannot
    price is refused naming the fix; a stored checkpoint is never priced as full width."""
    quant = _quantization_config(source)
    method = str(quant.get("quant_method", "")).lower() if quant else None
    where = f"model.config {str(source)!r}"
    refused = method and stored_scheme_mismatch(quantization, method, where)
    if refused:
        raise ConfigError(refused)
    if method is None:
        if quantization in ("auto", "none"):
            return FULL_WIDTH
        if quantization == "int8":
            return INT8
        if quantization == "fp8":
            return FP8_ROWS
        raise ConfigError(
            f"model.quantization: {quantization} prices a {quantization} checkpoint's weights, and {where} has "
            "no quantization_config: give that checkpoint's config.json, or set model.quantization: int8 "
            "or fp8 (quantized on load) or auto to simulate"
        )
    if method in ("gptq", "awq"):
        bits = quant.get("bits", quant.get("w_bit"))
        if bits != 4:
            raise ConfigError(f"{where}: a {bits}-bit {method} checkpoint; bm reads 4-bit ones")
        group = int(quant.get("group_size", quant.get("q_group_size", 128)))
        return WeightFormat(method, 4, None if group == -1 else group, _GROUP_BYTES)
    if method == "fp8":
        block = quant.get("weight_block_size")
        return WeightFormat(method, 8, int(block[1]) if block else None, _GROUP_BYTES)
    raise ConfigError(
        f"{where}: the simulator prices GPTQ and AWQ int4 and fp8 checkpoints, not {method!r} ones; give a "
        "full-width config.json (with model.quantization: int8 to price int8 weights)"
    )


def _quantization_config(source: str | Path | None) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` at ``source`` (a file or its folder), if any."""
    if source is None:
        return None
    p = Path(source)
    p = p / "config.json" if p.is_dir() else p
    try:
        quant = json.loads(p.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # ModelShape.from_file reports an unreadable config
    return quant if isinstance(quant, dict) and quant else None
