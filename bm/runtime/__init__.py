"""Everything that owns tensors: the model, the KV block tensors, paged attention and sampling."""

from bm.runtime.attention import ATTENTION_NAME, UnsupportedAttentionError
from bm.runtime.kv_sizing import KVCacheSizeError, num_kv_blocks
from bm.runtime.model_loader import LoadedModel, ModelLoadError, load_model, resolve_device
from bm.runtime.model_runner import ModelRunner, work_item
from bm.runtime.sampler import Sampler
from bm.runtime.tokenizer import ByteTokenizer, HFTokenizer, TextCodec

__all__ = [
    "ATTENTION_NAME",
    "ByteTokenizer",
    "HFTokenizer",
    "KVCacheSizeError",
    "LoadedModel",
    "ModelLoadError",
    "ModelRunner",
    "Sampler",
    "TextCodec",
    "UnsupportedAttentionError",
    "load_model",
    "num_kv_blocks",
    "resolve_device",
    "work_item",
]
