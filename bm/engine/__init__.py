"""The Batch Manager loop and its request surface (the seed's callbacks and InferenceRequest)."""

from bm.engine.batch_manager import BatchManager
from bm.engine.inference_request import InferenceRequest, RequestError, RequestLimits, parse_request
from bm.engine.offline import OfflineClient, RequestResult, generate

__all__ = [
    "BatchManager",
    "InferenceRequest",
    "OfflineClient",
    "RequestError",
    "RequestLimits",
    "RequestResult",
    "generate",
    "parse_request",
]
