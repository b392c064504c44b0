"""The shape of a decoder-only transformer, read from a Hugging Face ``config.json``: all the cost model
needs (no weights, no torch), so a simulated run of a 70B model needs only its config file."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bm.config import ConfigError

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
