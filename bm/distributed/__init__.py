"""Several processes, one run: data-parallel engine replicas and tensor-parallel model shards on
torch.distributed (gloo on CPU; ``torchrun`` for rendezvous across machines).

Rank 0 is the only rank that talks to the client (reads requests, writes files); every other rank runs
an engine replica or a shard of one and exchanges requests, responses and stats with rank 0 through
object collectives once per iteration. See :mod:`bm.distributed.engine` for the protocol. Which rank a
process is, and how a model's weights shard, are :mod:`bm.parallel`'s, below the runtime that asks.
"""

from __future__ import annotations
