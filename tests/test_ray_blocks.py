"""The plain-Python half of ``bm run --ray`` (no Ray needed): blocks are fixed line ranges that cover
every line once, a block's rows are the whole file's rows, parts are written whole and assembled in
input order, replicas are sized from the cluster's resources, and without ``--ray`` nothing imports Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from bm.parallel.layout import ParallelError
from bm.ray.blocks import (  # fmt: skip
    BatchOutputLines,
    PartStore,
    assemble,
    block_rows,
    file_verdicts,
    line_blocks,
    plan_blocks,
    read_bytes,
)
from bm.ray.placement import replica_layout
from bm.runfiles.identity import check_resume_mode
from bm.runfiles.openai_batch import IgnoredFieldNotices, iter_batch_file
from bm.runfiles.outdir import OutDirError
from bm.workloads.jsonl import iter_request_file
from tests.conftest import REPO
from tests.hang import HANG_S

LINES = [
    '{"prompt": "a", "id": "x"}',
    "",
    "not json",
    '{"input_ids": [1, 2], "max_tokens": 2}',
    '{"prompt": "b", "id": "x"}',  # a duplicate of line 1's id: only the whole file's reader sees it
    '{"prompt": "c\\r inside"}',
    '{"messages": [{"role": "user", "content": "hi"}]}',
]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(("\n".join(LINES)).encode())  # no newline after the last line
    return path


@pytest.mark.parametrize("block_lines", [1, 2, 3, 7, 50])
def test_blocks_cover_every_line_once_and_their_rows_are_the_whole_files_rows(prompts, block_lines):
    blocks = plan_blocks(prompts, block_lines)
    assert [i for b in blocks for i in b.indexes] == list(range(len(LINES)))
    assert all(b.block_id == n and b.first_number == n * block_lines + 1 for n, b in enumerate(blocks))
    assert b"".join(read_bytes(prompts, b) for b in blocks) == prompts.read_bytes()
    verdicts = file_verdicts(prompts)
    rows = [r for b in blocks for r in block_rows(read_bytes(prompts, b), b, prompts.parent, verdicts)]
    whole = list(iter_request_file(prompts))
    assert [vars(r) for r in rows] == [vars(r) for r in whole]
    assert "duplicate id" in rows[3].error and rows[1].error.startswith("line 3: malformed JSON")


@pytest.fixture
def batch_file(tmp_path):
    """An OpenAI batch file with a blank line and a line that is not JSON among good and refused ones."""
    from tests.test_cli_chat_batch import BATCH_LINES

    lines = [json.dumps(line) for line in BATCH_LINES]
    lines[2:2] = ["", "{not json"]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_drivers_pass_over_a_batch_file_says_each_ignored_field_once_naming_its_first_line(tmp_path):
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", **extra}}
        for i, extra in enumerate(
            [{"reasoning_effort": "low"}, {"modalities": ["text"]}, {"reasoning_effort": "high"}]
        )
    ]
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    said: list[str] = []
    assert file_verdicts(path, batch=True, notices=IgnoredFieldNotices(said.append)) == {}
    assert [text.split(" (")[0] for text in said] == ["body.reasoning_effort", "body.modalities"]
    assert "first on line 1" in said[0] and "first on line 2" in said[1]


@pytest.mark.parametrize("block_lines", [1, 3, 50])
def test_a_batch_files_blocks_are_read_as_the_one_process_run_reads_the_file(batch_file, block_lines):
    blocks = plan_blocks(batch_file, block_lines)
    assert file_verdicts(batch_file, batch=True) == {}  # duplicate custom ids are refused before the run
    rows = [r for b in blocks for r in block_rows(read_bytes(batch_file, b), b, batch_file.parent, {}, True)]
    whole = [line.parsed for line in iter_batch_file(batch_file)]
    assert [vars(r) for r in rows] == [vars(r) for r in whole]
    assert rows[0].messages and rows[0].error is None and rows[2].error.startswith("line 4: malformed JSON")


def test_a_resumed_assembly_writes_batch_output_whole_one_line_per_input_line(batch_file, tmp_path):
    """batch_output.jsonl is written from the records at each assembly, kept and new alike: a stale one
    (a first run's, lines of a killed driver) is replaced, never appended to."""
    out = tmp_path / "out"
    (out / "parts").mkdir(parents=True)
    (out / "batch_output.jsonl").write_text('{"id": "batch_req_bm_0", "custom_id": "chat-1"}\n{"id": "batch')
    store = PartStore(out)
    blocks = plan_blocks(batch_file, 4)
    for block in blocks[:-1]:  # the last block did not finish: its lines are cancelled
        rows = block_rows(read_bytes(batch_file, block), block, batch_file.parent, {}, True)
        store.write(
            block.block_id, [{"index": r.index, "finish_reason": "length", "text": "ok"} for r in rows]
        )
    missing = lambda block: [{"index": i, "finish_reason": "cancelled"} for i in block.indexes]  # noqa: E731
    for _ in range(2):  # a run, then its resume
        assemble(store, blocks, out, missing, lambda r: None, batch_output=writer(batch_file))
        lines = [json.loads(x) for x in (out / "batch_output.jsonl").read_text().splitlines()]
        expected = [line.custom_id for line in iter_batch_file(batch_file)]
        assert [x["custom_id"] for x in lines] == expected  # in input order, each once
        assert lines[-1]["error"]["code"] == "cancelled" and lines[0]["response"]["status_code"] == 200


def writer(batch_file):
    return lambda path: BatchOutputLines(batch_file, path, "tiny", None)


def test_a_driver_killed_while_assembling_leaves_the_previous_outputs_whole(batch_file, tmp_path):
    """outputs.jsonl and batch_output.jsonl are written beside their names and renamed once whole: while
    a resume assembles them (a kill now would stop it here) the previous run's files are untouched, and
    an assembly that stops half-way leaves them so, with no temporary file behind."""
    out = tmp_path / "out"
    store = PartStore(out)
    store.start(2)
    blocks = plan_blocks(batch_file, 2)

    def run_answering(text, count):
        for b in blocks:
            rows = block_rows(read_bytes(batch_file, b), b, batch_file.parent, {}, True)
            store.write(
                b.block_id, [{"index": r.index, "finish_reason": "length", "text": text} for r in rows]
            )
        assemble(store, blocks, out, None, count, batch_output=writer(batch_file))

    run_answering("first", lambda record: None)
    before = {name: (out / name).read_bytes() for name in ("outputs.jsonl", "batch_output.jsonl")}
    seen = []

    def killed_mid_way(record):
        assert all((out / name).read_bytes() == data for name, data in before.items())
        seen.append(record)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_answering("second", killed_mid_way)
    assert {name: (out / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in out.iterdir()) == ["batch_output.jsonl", "outputs.jsonl", "parts"]
    run_answering("second", lambda record: None)
    assert b'"second"' in (out / "batch_output.jsonl").read_bytes()


def test_a_block_narrowed_to_single_lines_skips_blank_lines(prompts):
    (block,) = plan_blocks(prompts, 50)
    singles = line_blocks(prompts, block)
    assert [s.block_id for s in singles] == [0, 2, 3, 4, 5, 6]
    assert [read_bytes(prompts, s).strip().decode() for s in singles] == [line for line in LINES if line]


def test_parts_are_written_whole_kept_when_final_and_assembled_in_input_order(prompts, tmp_path):
    out = tmp_path / "out"
    store = PartStore(out)
    store.start(3)
    blocks = plan_blocks(prompts, 3)
    store.write(1, [{"index": 4, "finish_reason": "length"}, {"index": 3, "finish_reason": "error"}])
    store.write(0, [{"index": 0, "finish_reason": "length"}, {"index": 2, "finish_reason": "error"}])
    assert store.block_lines() == 3 and [r["index"] for r in store.read(1)] == [3, 4]
    assert set(store.kept(0)) == {0} and store.kept(2) is None  # an error record is run again on resume
    assert not list(store.dir.glob(".*tmp"))
    seen = []
    missing = lambda block: [{"index": i, "finish_reason": "cancelled"} for i in block.indexes]  # noqa: E731
    assert assemble(store, blocks, out, missing, seen.append) == 5
    lines = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert [r["index"] for r in lines] == [0, 2, 3, 4, 6] and lines == seen
    store.start(5)  # a fresh run drops the old parts
    assert store.block_lines() == 5 and not store.has(0)


@pytest.mark.parametrize(
    ("resources", "replicas", "threads", "device", "expected"),
    [
        ({"CPU": 2}, 2, None, "auto", (2, 1.0, 0.0, 1)),  # the CI test: two 1-thread replicas on 2 cores
        ({"CPU": 16}, None, None, "auto", (4, 4.0, 0.0, 4)),  # CPUs over the default 4 threads
        ({"CPU": 16}, None, 8, "cpu", (2, 8.0, 0.0, 8)),
        ({"CPU": 2}, 4, 2, "auto", (4, 0.5, 0.0, 2)),  # more asked than fits: each reserves its share
        ({"CPU": 32, "GPU": 4}, None, None, "auto", (4, 1.0, 1.0, None)),  # one replica per GPU
        ({"CPU": 32, "GPU": 4}, None, None, "cpu", (8, 4.0, 0.0, 4)),  # the model pinned to the CPU
    ],
)
def test_replicas_come_from_the_clusters_resources_or_the_flags(
    resources, replicas, threads, device, expected
):
    assert replica_layout(resources, replicas, threads, device) == expected


def test_a_resume_goes_on_the_way_the_run_went(tmp_path):
    plain, ray_run = tmp_path / "plain", tmp_path / "ray"
    plain.mkdir()
    (plain / "outputs.jsonl").write_text("")
    (ray_run / "parts").mkdir(parents=True)
    with pytest.raises(OutDirError, match="resume it without --ray"):
        check_resume_mode(plain, ray=True)
    with pytest.raises(OutDirError, match="resume it with --ray"):
        check_resume_mode(ray_run, ray=False)
    check_resume_mode(plain, ray=False)
    check_resume_mode(ray_run, ray=True)


def test_bm_run_without_ray_imports_no_ray(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello", "max_tokens": 2}\n')
    script = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from bm.cli.main import app\n"
        f"result = CliRunner().invoke(app, ['run', {str(prompts)!r}, '-o', {str(tmp_path / 'out')!r}, '-q', "
        "'--set', 'model.device=cpu'])\n"
        "assert result.exit_code == 0, result.output\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=HANG_S, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("resources", "replicas", "tp", "expected"),
    [
        ({"CPU": 2}, 1, 2, (1, 2.0, 0.0, 1)),  # the CI test: one replica of two ranks, a thread each
        ({"CPU": 16}, None, 2, (2, 8.0, 0.0, 4)),  # each rank takes the default 4 threads
        ({"CPU": 16}, 4, 2, (4, 4.0, 0.0, 2)),  # the CPUs split over 4 x 2 ranks
        ({"CPU": 32, "GPU": 8}, None, 4, (2, 4.0, 4.0, None)),  # a GPU per rank, a CPU per rank
        ({"CPU": 32, "GPU": 8}, 1, 4, (1, 4.0, 4.0, None)),
    ],
)
def test_a_tensor_parallel_replica_reserves_a_gpu_or_its_threads_per_rank(resources, replicas, tp, expected):
    threads = 1 if resources == {"CPU": 2} else None
    assert replica_layout(resources, replicas, threads, "auto", tensor_parallel=tp) == expected


@pytest.mark.parametrize(
    ("gpus", "replicas", "message"),
    [
        (
            8,
            3,
            "--replicas 3 x --tensor-parallel 4 needs 12 GPUs, and the Ray cluster has 8: give --replicas 2 or fewer",
        ),
        (
            2,
            None,
            "--tensor-parallel 4: a replica takes 4 GPUs of one node, and the Ray cluster has 2; give --tensor-parallel 2 or fewer",
        ),
    ],
)
def test_tensor_parallel_replicas_that_do_not_fit_the_gpus_are_refused_naming_the_flag(
    gpus, replicas, message
):
    """A rank takes a whole GPU (Ray lends no fraction of more than one), so the replicas must fit."""
    with pytest.raises(ParallelError) as error:
        replica_layout({"CPU": 32, "GPU": gpus}, replicas, None, "auto", tensor_parallel=4)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(
    "name", ["StreamingExecutor-dataset_1", "ray-data-metadata-prefetch", "iter_threaded"]
)
def test_the_driver_disconnects_from_ray_only_after_ray_datas_dataset_threads_end(monkeypatch, name):
    """Closing Ray Data's row iterator only asks its threads to stop; one still running after
    ``ray.shutdown()`` made Ray end an interrupted run with status 1 instead of 130 (CI, 2 cores).
    ``disconnect`` joins those threads first, and only those: the long-lived ones would never end."""
    from bm.ray import session

    release, other = threading.Event(), threading.Event()
    executor = threading.Thread(target=release.wait, name=name, daemon=True)
    # Ray Data's block prefetcher stays parked for the process's life once a run is over: never waited
    unrelated = threading.Thread(target=other.wait, name="Prefetcher", daemon=True)
    executor.start(), unrelated.start()
    threading.Timer(0.3, release.set).start()  # its last step ends after the iterator was closed
    seen: list[bool] = []
    # Ray itself stays out of the test process (see tests/test_ray.py): only its shutdown is watched
    monkeypatch.setitem(
        sys.modules, "ray", types.SimpleNamespace(shutdown=lambda: seen.append(executor.is_alive()))
    )
    try:
        session.disconnect()
        assert seen == [False]  # shut down once, after the executor thread ended
        assert unrelated.is_alive()  # not a Ray Data thread: never waited for
    finally:
        other.set()


def test_a_ray_data_thread_that_never_ends_is_named_at_the_deadline_not_waited_for_forever():
    from bm.ray.session import wait_for_ray_data_threads

    stuck = threading.Event()
    thread = threading.Thread(target=stuck.wait, name="ray-data-metadata-prefetch", daemon=True)
    thread.start()
    try:
        assert wait_for_ray_data_threads(timeout_s=0.2) == ["ray-data-metadata-prefetch"]
    finally:
        stuck.set()
    thread.join()
    assert wait_for_ray_data_threads(timeout_s=0.2) == []


@pytest.mark.parametrize(
    ("address", "ray_address", "user_niceness", "want"),
    [
        (None, None, None, "0"),  # a cluster started for this run: its workers at the driver's priority
        (None, None, "10", "10"),  # the user's own setting wins
        ("ray://head:10001", None, None, None),  # the user's cluster keeps its settings
        (None, "head:6379", None, None),
    ],
)
def test_a_cluster_started_for_the_run_runs_its_replicas_at_the_drivers_priority(
    monkeypatch, address, ray_address, user_niceness, want
):
    """Ray starts workers at nice 15: beside two busy loops a 30-second ``bm run --ray`` took 20 minutes.
    Ray's raylet reads RAY_worker_niceness from the environment it starts in."""
    from bm.ray import session

    for name, value in (("RAY_ADDRESS", ray_address), (session.WORKER_NICENESS, user_niceness)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    seen: list[str | None] = []
    fake = types.SimpleNamespace(
        is_initialized=lambda: False, init=lambda **_: seen.append(os.environ.get(session.WORKER_NICENESS))
    )
    monkeypatch.setitem(sys.modules, "ray", fake)  # Ray itself stays out of the test process
    monkeypatch.setattr(session, "watch", lambda: None)
    assert session.connect(address) is True
    assert seen == [want]


def test_disconnecting_gives_sigterm_back_to_the_handler_python_lists(monkeypatch):
    """``ray.shutdown()`` resets SIGTERM's action in the kernel to the default while Python's table keeps
    bm's handler (a late SIGTERM then killed a run with -15): after ``disconnect`` the kernel calls the
    handler again. The fake shutdown resets the action as Ray's does, under Python's feet."""
    import ctypes

    from bm.ray import session

    libc = ctypes.CDLL(None)
    libc.signal.argtypes, libc.signal.restype = (ctypes.c_int, ctypes.c_void_p), ctypes.c_void_p

    def caught(sig: int) -> bool:
        status = Path("/proc/self/status").read_text().splitlines()
        mask = next(line for line in status if line.startswith("SigCgt:")).split()[1]
        return bool(int(mask, 16) >> (sig - 1) & 1)

    def shutdown() -> None:
        libc.signal(signal.SIGTERM, 0)  # SIG_DFL, behind Python's back

    handler = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(shutdown=shutdown))
        shutdown()
        assert not caught(signal.SIGTERM)  # what Ray leaves
        session.disconnect()
        assert caught(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, handler)


def test_a_sigterm_while_ray_starts_reaches_bms_handler_not_rays(monkeypatch):
    """``ray.init`` installs a SIGTERM handler that exits 15 before it starts the cluster (seconds under
    load): a busy soak's SIGTERM 10.6 s in ended a run with 15, no records and no resume command. The
    fake init installs as Ray's does, through ``ray._private.utils.set_sigterm_handler``."""
    from bm.ray import session

    utils = types.ModuleType("ray._private.utils")
    utils.set_sigterm_handler = lambda handler: signal.signal(signal.SIGTERM, handler)
    private = types.ModuleType("ray._private")
    private.utils = utils
    seen: list[object] = []

    def init(**_: object) -> None:
        sys.modules["ray._private.utils"].set_sigterm_handler(lambda *_: sys.exit(15))
        seen.append(signal.getsignal(signal.SIGTERM))  # what a SIGTERM here would run

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init)
    for name, module in (("ray", fake), ("ray._private", private), ("ray._private.utils", utils)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(session, "watch", lambda: None)

    def bms(*_: object) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, bms)
    try:
        assert session.connect("ray://head:10001") is True
        assert seen == [bms]
        assert utils.set_sigterm_handler is not None and signal.getsignal(signal.SIGTERM) is bms
    finally:
        signal.signal(signal.SIGTERM, previous)
