"""One engine replica of ``bm run --ray``: a Ray actor (Ray Data's map worker) that holds its own
``bm.LLM`` (its own config, device, KV cache) and turns blocks of prompt lines into their records.

The replica builds each line's request and record with the code a one-process ``bm run`` uses
(:func:`bm.runfiles.prompts.to_request`, :func:`bm.runfiles.records.output_record`), seeding an
unseeded line from the run seed and its index, so a record does not depend on which replica ran its
line or with what else in the batch. One engine session serves every block the actor runs; up to
:data:`BLOCKS_PER_REPLICA` blocks run at once (Ray Data calls the actor from that many threads), so the
engine's batch stays full across block boundaries instead of draining at the end of each block.

With ``--tensor-parallel N`` the actor is rank 0 of a process group of its own, with ranks 1..N-1 as
child processes (:func:`bm.distributed.worker.start_replica_ranks`); its ``bm.LLM`` then loads rank 0's
shard and its session is the multi-rank engine, the same one ``bm run --tensor-parallel`` drives. A
rank that dies ends the actor's process (never error records), so Ray restarts it and retries its blocks
as for any dead replica; the ranks die with the actor.

This module imports no Ray at import time; Ray Data instantiates :class:`Replica` in its worker.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bm.config import BmConfig
from bm.engine.requests.request import Request, Response
from bm.ray.blocks import Block, block_rows, read_bytes
from bm.runfiles.prompts import codec_for, to_requests
from bm.runfiles.records import LineParts, output_record
from bm.runfiles.served_models import ServedModels

BLOCKS_PER_REPLICA = 2
# A test hook, read by the driver and handed to each replica: "exit_after=N:MARKER" makes the first
# replica whose process has finished N lines (on its first life) exit mid-block, once per MARKER file;
# "poison=TEXT" makes a replica's process exit whenever it runs a line whose prompt holds TEXT;
# "slow=SECONDS" makes every block take that much longer (a driver can then be killed mid-run);
# "kill_rank=N:MARKER" is exit_after's tensor-parallel twin: the replica kills its rank 1 instead.
FAULT_ENV = "BM_RAY_TEST_FAULT"


@dataclass(frozen=True)
class LineOptions:
    """What a line's request and record depend on besides the line: ``bm run``'s own flags."""

    default_max_tokens: int
    ignore_eos: bool
    run_seed: int | None
    chat_template: str | None = None
    tool_call_parser: str | None = None


class Replica:
    """Ray Data's callable class: built once per actor (and again when Ray restarts the actor after its
    process died), then called with batches of blocks."""

    def __init__(
        self,
        config: BmConfig,
        options: LineOptions,
        prompts: str,
        threads: int | None = None,
        fault: str | None = None,
        logits_dir: str | None = None,
        batch: bool = False,
        tensor_parallel: int = 1,
        rank_timeout_s: float = 300.0,
    ) -> None:
        if threads:
            import torch

            torch.set_num_threads(threads)
        if tensor_parallel > 1:  # this process becomes rank 0 of its own group, before the model loads
            from bm.distributed.worker import start_replica_ranks

            start_replica_ranks(config, tensor_parallel, rank_timeout_s, threads)
        from bm.llm import LLM

        self.llm = LLM(config=config)
        loaded = self.llm.loaded
        self.options = options
        self.prompts = Path(prompts)  # read where the replica runs: the same path on every node
        self.batch = batch  # an OpenAI batch file: its lines read by bm.runfiles.openai_batch's parser
        self.logits_dir = Path(logits_dir) if logits_dir else None
        self.codec = codec_for(
            loaded, options.chat_template, options.tool_call_parser, config.engine.max_seq_len
        )
        self.end_id = None if options.ignore_eos else loaded.eos_token_id
        self.fault = _Fault.parse(fault)
        self.restarted = _was_restarted()
        self.name = _replica_name()
        if self.restarted:  # Ray's own log says the actor died; this says what happens to its work
            print(
                f"bm run --ray: replica {self.name} restarted after its previous process died; "
                "Ray retries the blocks that process held",
                file=sys.stderr,
                flush=True,
            )
        self._lock = threading.Lock()
        self._sinks: dict[int, queue.Queue[Response]] = {}
        self._stats: list[str] = []
        self._lines_done = 0
        self._reported_restart = False
        self._session = self.llm.session(return_stats=self._stats.append)
        self._collector = threading.Thread(target=self._collect, daemon=True, name="bm-ray-collect")
        self._collector.start()

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        """Each block of the batch (one, as Ray Data hands them) to its records, as one row per block:
        ``part`` (the records, JSON lines), ``stats`` (the engine's iteration stats while it ran),
        ``replica``, ``restarted`` (the first block of a replica that Ray restarted) and ``loaded`` (the
        model as it loaded, for run.json)."""
        out: dict[str, list[Any]] = {
            "block": [],
            "part": [],
            "stats": [],
            "replica": [],
            "restarted": [],
            "loaded": [],
        }
        for i in range(len(batch["block"])):
            block = Block(*(int(batch[key][i]) for key in ("block", "start", "end", "first", "lines")))
            verdicts = {int(k): v for k, v in json.loads(str(batch["verdicts"][i])).items()}
            skip = set(json.loads(str(batch["skip"][i])))
            records, stats = self.run_block(block, read_bytes(self.prompts, block), verdicts, skip)
            with self._lock:
                restarted, self._reported_restart = (
                    self.restarted and not self._reported_restart,
                    True,
                )
            out["block"].append(block.block_id)
            out["part"].append("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            out["stats"].append("".join(line + "\n" for line in stats))
            out["replica"].append(self.name)
            out["restarted"].append(restarted)
            out["loaded"].append(self.llm.loaded.name)
        return out

    def run_block(
        self, block: Block, data: bytes, verdicts: dict[int, str], skip: set[int]
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """The records of the block's lines not in ``skip`` (their final records are kept from an
        earlier run), and the stats lines the engine wrote meanwhile."""
        loaded = self.llm.loaded
        records: list[dict[str, Any]] = []
        sink: queue.Queue[Response] = queue.Queue()
        rows = {}  # by engine request id
        parts = LineParts()
        stats_from = len(self._stats)
        if self.fault.slow_s:
            time.sleep(self.fault.slow_s)
        served = ServedModels.of(self.llm.config.model)
        for row in block_rows(data, block, self.prompts.parent, verdicts, self.batch, served):
            if row.index in skip:
                continue
            self.fault.check_line(row)
            requests = to_requests(
                row, self.codec, self.options.default_max_tokens, self.end_id, self.options.run_seed
            )
            if requests is None:
                records.append(output_record(row, None, loaded))
                continue
            for part, request in requests:  # one, or one per prompt of a completions prompt list
                rows[request.request_id] = part
                self._submit(request, sink)
        while rows:
            try:
                result = sink.get(timeout=1.0)
            except queue.Empty:
                if not self._session.alive:  # the block fails; Ray Data retries or isolates it
                    raise RuntimeError(f"the batch manager stopped: {self._session.error}") from None
                continue
            row = rows.pop(result.request_id)
            whole = parts.add(row, self._record(row, result))  # a line's record once all its prompts end
            if whole is not None:
                records.append(whole)
                self._line_done()
        return records, self._stats[stats_from:]

    def _record(self, row: Any, result: Response) -> dict[str, Any]:
        record = output_record(row, result, self.llm.loaded)
        if self.logits_dir is not None:
            from bm.runfiles.records import write_logits

            logits_file = write_logits(self.logits_dir, row.index, result)
            if logits_file is not None:
                record["logits_file"] = logits_file
        return record

    def _submit(self, request: Request, sink: queue.Queue[Response]) -> None:
        with self._lock:
            self._sinks[request.request_id] = sink
        self._session.submit(request)

    def _collect(self) -> None:
        """Hand each final response to the block that is waiting for it (request ids are line indexes, or
        derived from them for a line's later prompts: unique across blocks)."""
        while self._session.alive:
            result = self._session.next_final(timeout=0.5)
            if result is not None:
                with self._lock:
                    sink = self._sinks.pop(result.request_id)
                sink.put(result)

    def _line_done(self) -> None:
        with self._lock:
            self._lines_done += 1
            done = self._lines_done
        if not self.restarted:
            self.fault.check_count(done)


@dataclass(frozen=True)
class _Fault:
    """The test hook of :data:`FAULT_ENV`, parsed; an empty one does nothing."""

    exit_after: int | None = None
    marker: str | None = None
    poison: str | None = None
    slow_s: float = 0.0
    kill_rank: bool = False  # at exit_after lines, kill this replica's rank 1 rather than exit

    @classmethod
    def parse(cls, text: str | None) -> _Fault:
        if not text:
            return cls()
        key, _, value = text.partition("=")
        if key in ("exit_after", "kill_rank"):
            count, _, marker = value.partition(":")
            return cls(exit_after=int(count), marker=marker, kill_rank=key == "kill_rank")
        if key == "poison":
            return cls(poison=value)
        if key == "slow":
            return cls(slow_s=float(value))
        raise ValueError(
            f"{FAULT_ENV}: expected exit_after=N:MARKER, kill_rank=N:MARKER, poison=TEXT or slow=S, got {text!r}"
        )

    def check_count(self, done: int) -> None:
        if self.exit_after is None or done < self.exit_after or self.marker is None:
            return
        try:  # the marker makes it one replica, once
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        if self.kill_rank:
            import signal

            from bm.parallel.layout import launched_ranks

            rank1 = launched_ranks()[0]
            print(
                f"bm run --ray: test fault: replica pid {os.getpid()} kills its rank 1 (pid {rank1})",
                flush=True,
            )
            os.kill(rank1, signal.SIGKILL)
            return
        print(f"bm run --ray: test fault: replica pid {os.getpid()} exits after {done} lines", flush=True)
        os._exit(1)

    def check_line(self, row: Any) -> None:
        if self.poison is not None and self.poison in (row.prompt or ""):
            print(f"bm run --ray: test fault: {row.where} is poison; pid {os.getpid()} exits", flush=True)
            os._exit(1)


def _replica_name() -> str:
    """``pid N on node ID`` (ID: the first 8 hex digits of Ray's node id, which Ray's tools show whole): the
    name of this replica in the log, ``stats.jsonl`` and ``summary.json``, which says what ran where when
    the replicas span machines. ``pid N`` outside an actor."""
    name = f"pid {os.getpid()}"
    try:
        import ray

        node = ray.get_runtime_context().get_node_id()
    except Exception:  # outside an actor (a test calling the class directly)
        return name
    return f"{name} on node {node[:8]}" if node else name


def _was_restarted() -> bool:
    """True in an actor that Ray restarted after its process died (its constructor runs again)."""
    import warnings

    try:
        import ray

        with warnings.catch_warnings():  # the property reads a deprecated one inside Ray itself
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # outside an actor (a test calling the class directly)
        return False
