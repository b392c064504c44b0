"""Which rank this process is and how a model shards across ranks: the process layout (tensor- and
data-parallel groups, starting the ranks) and the tensor-parallel split of a model's weights.

This sits below :mod:`bm.runtime`, which asks it where to put a model and which shard to load;
:mod:`bm.distributed`, above the runtime and the engine, runs an engine replica or shard on each rank
and exchanges requests and responses between them.
"""

from __future__ import annotations

from bm.parallel.layout import ParallelLayout, current_layout, parallel_info, setup_parallel

__all__ = ["ParallelLayout", "current_layout", "parallel_info", "setup_parallel"]
