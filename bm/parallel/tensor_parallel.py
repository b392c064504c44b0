"""Loading one rank's shard of a model with transformers' own tensor-parallel plan (``tp_plan="auto"``).

The plan comes with the model family (``base_model_tp_plan`` in its config: which projections split by
column, which by row). bm adds nothing to it: each rank's attention then sees only its local heads, and
bm's paged attention, which takes the head count from the tensors it is given, caches those alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bm.parallel.layout import ParallelLayout, mesh_device_type


class TensorParallelError(ValueError):
    """The model cannot be split over the ranks asked for; the message says which setting to change.

    The model loader reports it as its own ``ModelLoadError`` (this module sits below the loader and
    does not import it back)."""


def distributed_config(path: Path, layout: ParallelLayout) -> Any:
    """transformers' DistributedConfig for this layout, after checking the model can be split.

    With one replica, ``from_pretrained`` loads each rank's shard directly. With several, its loader
    would build a mesh with a data-parallel dimension and wrap the model in FSDP2 (which cannot run
    under inference mode), so there the full model is loaded and :func:`shard_replica` applies the
    same plan on the replica's own sub-mesh instead (more memory while loading, the same shards)."""
    from transformers import AutoConfig
    from transformers.distributed import DistributedConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True).get_text_config()
    tp = layout.tensor_parallel
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise TensorParallelError(
            f"model.path {str(path)!r}: the {config.model_type!r} family ships no tensor-parallel plan "
            "(base_model_tp_plan) in this transformers version, so it cannot be split over ranks; "
            "drop --tensor-parallel (or use --data-parallel)"
        )
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if heads is not None and heads % tp:
            raise TensorParallelError(
                f"model.path {str(path)!r}: {name} is {heads}, which {tp} ranks cannot split evenly; "
                f"use a --tensor-parallel that divides it"
            )
    if layout.data_parallel > 1:
        return None
    return DistributedConfig(tp_plan="auto", tp_size=tp)


def shard_replica(model: Any, layout: ParallelLayout) -> Any:
    """Split a fully loaded model over this replica's ranks with the model's own tp plan (the path for
    ``--data-parallel`` with ``--tensor-parallel``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    mesh = init_device_mesh(
        mesh_device_type(), (layout.data_parallel, layout.tensor_parallel), mesh_dim_names=("dp", "tp")
    )["tp"]
    plan, _ep, _fsdp = model._resolve_parallel_plans(
        DistributedConfig(tp_plan="auto", tp_size=layout.tensor_parallel)
    )
    return apply_tensor_parallelism(model, mesh, plan)
