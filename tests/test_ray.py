"""``bm run --ray`` on a local Ray cluster (2 CPUs, started once for the module): two CPU replicas of the
tiny model; a replica killed mid-run, a poison line, a driver killed and resumed. Every run must end
with exactly one record per line, each equal to a one-process ``bm run`` with the same ``--seed``.

Ray stays out of the test process: the cluster is started with ``ray start`` and every ``--ray`` run is
a ``bm`` subprocess. A Ray driver inside pytest left the process holding gigabytes of address space
after ``ray.shutdown()``, and a later test's ``fork()`` then failed with ENOMEM."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import REPO
from tests.hang import HANG_S

ray = pytest.importorskip("ray")

from bm.cli.main import app  # noqa: E402
from bm.ray.replica import FAULT_ENV  # noqa: E402
from bm.ray.session import WORKER_NICENESS  # noqa: E402

# Ray Data's own configuration warns of its deprecated fields when it is copied; not bm's to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
runner = CliRunner()
NUM_LINES = 2000
BLOCK_LINES = 100
COMMON = ["-q", "--seed", "7", "--set", "model.device=cpu", "--set", "kv_cache.max_tokens=4096"]
RAY_FLAGS = ["--ray", "--replicas", "2", "--block-lines", str(BLOCK_LINES)]


# A local test cluster without Ray's token authentication: its drivers are other processes, which
# would otherwise need the token the starting process keeps to itself.
NO_TOKEN = {"RAY_AUTH_MODE": "disabled"}
# The test clusters' workers (the replicas) at the tests' priority, as a cluster bm run --ray starts runs
# them (bm.ray.session): at Ray's default nice 15, beside a busy machine's other work, one test took minutes.
TEST_CLUSTER = {**NO_TOKEN, WORKER_NICENESS: "0"}
# A process that starts a local cluster, prints its address and holds it until its stdin closes.
HOLD_CLUSTER = (
    "import ray, sys; ray.init(num_cpus=2, include_dashboard=False, logging_level='warning'); "
    "print(ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read()"
)


@pytest.fixture(scope="module")
def cluster():
    """One local cluster for the module, in processes of its own: starting Ray costs seconds, a run on
    it much less."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, **TEST_CLUSTER},
    )  # fmt: skip
    try:
        address = holder.stdout.readline().strip()
        assert address, "the Ray cluster did not start"
        yield address
    finally:
        holder.stdin.close()  # ray.init's cluster stops with the process that started it
        holder.wait(timeout=HANG_S)


def driver_env(cluster: str, **env: str) -> dict[str, str]:
    return {
        **os.environ,
        **NO_TOKEN,
        "PYTHONPATH": str(REPO),
        "RAY_ADDRESS": cluster,
        "COLUMNS": "200",
        **env,
    }


def bm_run(cluster: str, args: list[str], **env: str) -> subprocess.CompletedProcess:
    """``bm run ARGS`` in a subprocess on the cluster (stdout and stderr together, as a terminal shows)."""
    command = [sys.executable, "-m", "bm", "run", *args]
    return subprocess.run(
        command, env=driver_env(cluster, **env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=HANG_S,
    )  # fmt: skip


def run_batch_process(cluster: str, **kwargs: object) -> subprocess.CompletedProcess:
    """``bm.ray.run_batch(**kwargs)`` in a subprocess on the cluster (a driver, like ``bm_run``'s)."""
    script = "import json, sys, bm.ray; bm.ray.run_batch(**json.loads(sys.argv[1]))"
    return subprocess.run(
        [sys.executable, "-c", script, json.dumps(kwargs)], env=driver_env(cluster), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=HANG_S,
    )  # fmt: skip


def driver_with_parts(cluster: str, prompts, out, num_parts: int) -> subprocess.Popen:
    """A slowed ``bm run --ray`` driver, returned once ``num_parts`` blocks are written (to be stopped)."""
    command = [sys.executable, "-m", "bm", "run", str(prompts), "-o", str(out), *COMMON, *RAY_FLAGS]
    env = driver_env(cluster, **{FAULT_ENV: "slow=0.3"})
    driver = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while len(list((out / "parts").glob("block-*.jsonl"))) < num_parts:  # the driver's event, not a clock
        assert driver.poll() is None, driver.communicate()[1][-3000:]
        time.sleep(0.05)
    return driver


def write_prompts(path, n, poison_at=None):
    """Mixed prompt lengths; every third line samples (so the per-line seeds matter), the rest greedy."""
    with path.open("w") as f:
        for i in range(n):
            row = {
                "prompt": ("POISON " if i == poison_at else "") + f"line {i} " * (1 + i % 4),
                "max_tokens": 3,
            }
            if i % 3 == 1:
                row["temperature"] = 0.9
            f.write(json.dumps(row) + "\n")
    return path


def records(out):
    return [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]


def by_index(rows):
    return {r["index"]: r for r in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The 2,000-line file and its records from a one-process ``bm run`` (no Ray)."""
    folder = tmp_path_factory.mktemp("reference")
    prompts = write_prompts(folder / "p.jsonl", NUM_LINES)
    result = runner.invoke(app, ["run", str(prompts), "-o", str(folder / "out"), *COMMON])
    assert result.exit_code == 0, result.output
    return prompts, by_index(records(folder / "out"))


def test_two_replicas_one_killed_mid_run_give_one_record_per_line_equal_to_one_process(
    cluster, reference, tmp_path
):
    prompts, expected = reference
    out = tmp_path / "out"
    fault = {FAULT_ENV: f"exit_after=300:{tmp_path / 'killed-once'}"}
    result = bm_run(cluster, [str(prompts), "-o", str(out), *COMMON, *RAY_FLAGS], **fault)
    assert result.returncode == 0, result.stdout[-3000:]
    assert (tmp_path / "killed-once").exists()  # a replica did exit mid-run
    rows = records(out)
    assert [r["index"] for r in rows] == list(range(NUM_LINES))  # one per line, in input order
    assert by_index(rows) == expected
    text = " ".join(result.stdout.split())
    assert "retries remaining, so the task will be retried" in text  # Ray's own retry line
    assert "was restarted after its process died; Ray retried its unfinished block(s)" in text
    ray_report = json.loads((out / "summary.json").read_text())["parallel"]["ray"]
    assert ray_report["num_replica_restarts"] >= 1 and ray_report["num_blocks_failed"] == 0
    assert (
        ray_report["replicas"] == 2
        and sum(ray_report["blocks_by_replica"].values()) == NUM_LINES // BLOCK_LINES
    )


def test_a_poison_line_ends_as_one_error_record_and_every_other_line_completes(cluster, tmp_path):
    n, poison = 20, 7
    prompts = write_prompts(tmp_path / "p.jsonl", n, poison_at=poison)
    out = tmp_path / "out"
    args = [str(prompts), "-o", str(out), *COMMON, "--ray", "--replicas", "2", "--block-lines", "5"]
    # each restart reloads the model: keep the tries few
    result = bm_run(cluster, [*args, "--ray-tries", "1"], **{FAULT_ENV: "poison=POISON"})
    assert result.returncode == 0, result.stdout[-3000:]  # some lines succeeded: the run is not failed
    rows = records(out)
    assert [r["index"] for r in rows] == list(range(n))
    failed = [r for r in rows if r["finish_reason"] == "error"]
    assert [r["index"] for r in failed] == [poison]
    assert failed[0]["error"].startswith(f"line {poison + 1}: the replica failed on this line on its one try")
    assert all(r["error"] is None and r["output_ids"] for r in rows if r["index"] != poison)
    text = " ".join(result.stdout.split())
    # the poison block (and any block that shared a dying replica with it each time) is narrowed down
    assert re.search(r"block\(s\) failed on their one try; running their \d+ line\(s\) one at a time", text)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_failed"] == 1 and summary["parallel"]["ray"]["lines_failed"] == [poison]


def test_resume_after_the_driver_is_killed_reruns_only_the_blocks_without_records(
    cluster, reference, tmp_path
):
    prompts, expected = reference
    out, parts = tmp_path / "out", tmp_path / "out" / "parts"
    driver = driver_with_parts(cluster, prompts, out, 3)
    driver.send_signal(signal.SIGKILL)  # no handler, no summary, no outputs.jsonl
    driver.communicate()
    done = {p.name for p in parts.glob("block-*.jsonl")}
    assert 3 <= len(done) < NUM_LINES // BLOCK_LINES and not (out / "outputs.jsonl").exists()
    before = {name: (parts / name).read_bytes() for name in done}

    result = bm_run(cluster, [str(prompts), "-o", str(out), *COMMON, *RAY_FLAGS, "--resume"])
    assert result.returncode == 0, result.stdout[-3000:]
    rows = records(out)
    assert [r["index"] for r in rows] == list(range(NUM_LINES))
    assert by_index(rows) == expected
    assert all((parts / name).read_bytes() == data for name, data in before.items())  # kept, not rerun
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parallel"]["ray"]["num_blocks_kept"] == len(done)
    assert (
        summary["num_resumed"] == len(done) * BLOCK_LINES
        and summary["num_requests"] == NUM_LINES - summary["num_resumed"]
    )
    # a plain resume of a --ray directory is refused: its records are in parts/
    plain = runner.invoke(app, ["run", str(prompts), "-o", str(out), *COMMON, "--resume"])
    assert plain.exit_code == 2 and "resume it with --ray" in " ".join(plain.output.split())


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_cancels_the_blocks_not_done_keeps_every_record_and_resumes_to_the_same_records(
    cluster, reference, tmp_path, sig
):
    """A first Ctrl-C stops after the blocks that are finishing: every line still has its record (the
    blocks not done get ``cancelled`` ones), the run exits 130 naming ``--resume``, and the resume runs
    only those blocks, ending with the records of an uninterrupted run. SIGTERM does the same: ray.init
    took it over (exit 15, a native dump, no outputs.jsonl) before bm.ray.session kept bm's handler."""
    prompts, expected = reference
    out = tmp_path / "out"
    driver = driver_with_parts(cluster, prompts, out, 2)
    driver.send_signal(getattr(signal, sig))
    stdout, stderr = driver.communicate(timeout=HANG_S)
    assert driver.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert f"-o {out} --resume" in " ".join(stdout.split())
    rows = records(out)
    assert [r["index"] for r in rows] == list(range(NUM_LINES))  # one record per line, interrupted or not
    cancelled = [r for r in rows if r["finish_reason"] == "cancelled"]
    assert cancelled and len(cancelled) % BLOCK_LINES == 0  # whole blocks, never part of one
    assert all(
        by_index(rows)[i] == expected[i]
        for i, r in by_index(rows).items()
        if r["finish_reason"] != "cancelled"
    )
    assert json.loads((out / "summary.json").read_text())["interrupted"]

    result = bm_run(cluster, [str(prompts), "-o", str(out), *COMMON, *RAY_FLAGS, "--resume"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert by_index(records(out)) == expected


def process_tree(root: int) -> dict[int, int]:
    """The live descendants of ``root``: pid -> start time (in clock ticks, so a reused pid is not one)."""
    stats = {}
    for entry in os.listdir("/proc"):
        try:
            text = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        if text:
            fields = text[text.rindex(")") + 2 :].split()
            stats[int(entry)] = (int(fields[1]), int(fields[19]))
    tree, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, start) in stats.items():
            if ppid == parent and pid not in tree:
                tree[pid] = start
                todo.append(pid)
    return tree


def still_alive(tree: dict[int, int]) -> list[int]:
    alive = []
    for pid, start in tree.items():
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2 :].split()[19]) == start:
            alive.append(pid)
    return alive


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_a_sigkilled_driver_that_started_its_own_cluster_leaves_no_ray_process_behind(tmp_path):
    """Issue 53: with the cluster started by the driver (no RAY_ADDRESS), a SIGKILLed driver left Ray's
    DashboardAgent and RuntimeEnvAgent alive under PID 1 (about a minute here, each blocked reporting
    the raylet's death to the dead GCS; for ever where that call hangs). Every process of the cluster
    carries bm.reaper's mark, so its watcher ends whatever outlives the driver."""
    prompts = write_prompts(tmp_path / "p.jsonl", 400)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "bm", "run", str(prompts), "-o", str(out), *COMMON, *RAY_FLAGS]
    env = {k: v for k, v in os.environ.items() if k not in NO_TOKEN}  # Ray's defaults: the user's case
    env |= {"PYTHONPATH": str(REPO), FAULT_ENV: "slow=0.3"}
    driver = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not list((out / "parts").glob("block-*.jsonl")):  # the cluster and its replicas are up
        assert driver.poll() is None, driver.communicate()[1][-3000:]
        time.sleep(0.05)
    tree = process_tree(driver.pid)
    commands = {pid: Path(f"/proc/{pid}/cmdline").read_text() for pid in still_alive(tree)}
    assert any("raylet" in c for c in commands.values()) and any("Agent" in c for c in commands.values())
    # the watcher is up (the mark itself is not read back here: Ray's processes rename themselves with
    # setproctitle, which may write the new title over the area /proc/PID/environ shows)
    assert any("bm.reaper" in c for c in commands.values())
    driver.kill()
    driver.wait()
    waited = 0.0
    while still_alive(tree) and waited < HANG_S:
        time.sleep(0.2)
        waited += 0.2
    assert still_alive(tree) == [], [Path(f"/proc/{p}/cmdline").read_text() for p in still_alive(tree)]


def batch_lines_of(out):
    """``batch_output.jsonl`` by custom_id, less ``created`` (the time the output was written)."""
    lines = [json.loads(x) for x in (out / "batch_output.jsonl").read_text().splitlines()]
    assert len(lines) == len({x["custom_id"] for x in lines})  # no custom_id twice
    for line in lines:
        if line["response"] is not None:
            line["response"]["body"].pop("created", None)
    return {x["custom_id"]: x for x in lines}


def test_an_openai_batch_file_gives_the_records_and_batch_output_of_one_process(cluster, tmp_path):
    """Chat and completion lines (logprobs, top_logprobs, n=2, refused fields), in blocks of 3 on two
    replicas: the same records and output lines as a one-process run with the same seed; and the same
    again from ``bm.ray.run_batch(chat_template=...)``. (The resume of batch_output.jsonl is assembly's
    alone: tests/test_ray_blocks.py.)"""
    from tests.test_cli_chat_batch import BATCH_LINES, TEMPLATE

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in BATCH_LINES))
    args = ["run", str(batch), *COMMON, "--chat-template", str(template)]
    result = runner.invoke(app, [*args, "-o", str(tmp_path / "one")])
    assert result.exit_code == 0, result.output
    out = tmp_path / "ray"
    result = bm_run(cluster, [*args[1:], "-o", str(out), "--ray", "--replicas", "2", "--block-lines", "3"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert "OpenAI batch output:" in result.stdout
    rows = records(out)
    assert [r["index"] for r in rows] == list(range(len(BATCH_LINES)))
    assert by_index(rows) == by_index(records(tmp_path / "one"))
    expected = batch_lines_of(tmp_path / "one")
    assert batch_lines_of(out) == expected and len(expected) == len(BATCH_LINES)
    # token strings decoded on the driver (its tokenizer alone), as the one process decodes them
    top = expected["top"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert top and all(len(token["top_logprobs"]) == 3 for token in top)
    assert json.loads((out / "summary.json").read_text())["parallel"]["ray"]["num_blocks"] == 3

    library = tmp_path / "library"
    options = {"device": "cpu", "kv_cache": {"max_tokens": 4096}, "seed": 7, "replicas": 1}
    done = run_batch_process(
        cluster, prompts=str(batch), out_dir=str(library), chat_template=str(template), **options
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert records(library) == rows and batch_lines_of(library) == expected


def test_ray_says_each_unknown_body_field_once_for_the_run_before_the_replicas_start(cluster, tmp_path):
    """Unknown body fields on lines of several blocks: one warning per field name, naming its first line,
    as a one-process run gives; said by the driver's pass over the file, not by each replica."""
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once", "max_tokens": 2, "temperature": 0, **extra}}
        for i, extra in enumerate(
            [{"reasoning_effort": "low"}, {}, {"reasoning_effort": "high", "verbosity": "low"}, {"verbosity": "x"}]
        )
    ]  # fmt: skip
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    flags = ["--ray", "--replicas", "2", "--block-lines", "2"]
    result = bm_run(cluster, [str(batch), *COMMON, "-o", str(tmp_path / "ray"), *flags])
    assert result.returncode == 0, result.stdout[-3000:]
    said = " ".join(result.stdout.split())
    assert said.count("body.reasoning_effort") == 1 and "body.reasoning_effort (first on line 1)" in said
    assert said.count("body.verbosity") == 1 and "body.verbosity (first on line 3)" in said
    assert said.index("body.verbosity") < said.index("bm run --ray:")  # before any block is handed out


def test_run_batch_checks_its_chat_template_as_the_cli_does_naming_its_argument(tmp_path):
    """The one check of --chat-template, before any replica (or Ray) starts; the error names the
    argument as the caller wrote it."""
    from bm.chat_template import ChatTemplateError
    from bm.ray import run_batch

    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    (tmp_path / "bad.jinja").write_text("{% if %}")
    for name, error in (("missing.jinja", "no such file"), ("bad.jinja", "not a valid Jinja template")):
        with pytest.raises(ChatTemplateError, match=f"^chat_template '.*{name}': {error}"):
            run_batch(prompts, tmp_path / "out", device="cpu", chat_template=tmp_path / name)
    assert not (tmp_path / "out").exists()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# A node stopped by SIGTERM first waits up to 30 s for Ray Serve to drain it; nothing here serves.
NO_DRAIN = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def ray_start(log: Path, *flags: str, **env: str) -> subprocess.Popen:
    """``ray start --block FLAGS``: one Ray node in a session of its own, stopped by SIGTERM to this one
    process (Ray's own handler then ends the node's processes), never by ``ray stop``, which ends every
    Ray process on the machine by name, other runs' clusters included. The dashboard agent's fixed
    default port is replaced, so two nodes (and other runs) can share the machine."""
    command = [str(Path(sys.executable).parent / "ray"), "start", "--block", "--disable-usage-stats"]
    command += [f"--dashboard-agent-listen-port={free_port()}", *flags]
    with log.open("w") as out:
        return subprocess.Popen(
            command, env={**os.environ, **TEST_CLUSTER, **NO_DRAIN, **env}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def stop_node(node: subprocess.Popen) -> None:
    if node.poll() is None:
        node.terminate()
        try:
            node.wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)  # the node's own session: its processes alone
            node.wait()


WAIT_FOR_NODES = (
    "import ray, sys, time; ray.init(address=sys.argv[1], logging_level='warning'); "
    "deadline = time.monotonic() + 1200\n"
    "while sum(n['Alive'] for n in ray.nodes()) < 2 and time.monotonic() < deadline: time.sleep(0.2)\n"
    "print(sum(n['Alive'] for n in ray.nodes()))"
)


def test_the_several_machines_recipe_on_two_nodes_of_this_machine(tmp_path):
    """docs/parallel.md's recipe (``ray start --head``, ``ray start --address`` on another node, then
    ``bm run PROMPTS --ray`` on the head node, which finds the cluster ``ray start`` made there), with
    both nodes on this machine: a CPU each, so each node holds one of the two replicas. Every line gets
    the one-process record, and the replicas' names say both nodes ran blocks (each block is slowed, so
    that the first replica up cannot finish the file before the other has loaded)."""
    n = 48
    prompts = write_prompts(tmp_path / "p.jsonl", n)
    result = runner.invoke(app, ["run", str(prompts), "-o", str(tmp_path / "one"), *COMMON])
    assert result.exit_code == 0, result.output
    expected = by_index(records(tmp_path / "one"))
    # RAY_TMPDIR keeps this cluster's files, and the address file the driver finds it by, out of /tmp/ray,
    # where another run's ray.init() would find it too (a short path: Ray's sockets live under it).
    temp = Path(tempfile.mkdtemp(prefix="bmray", dir="/tmp"))
    nodes: list[subprocess.Popen] = []
    try:
        port = free_port()
        head_flags = [f"--port={port}", "--num-cpus=1", "--include-dashboard=false"]
        nodes.append(ray_start(tmp_path / "head.log", "--head", *head_flags, RAY_TMPDIR=str(temp)))
        address_file = temp / "ray" / "ray_current_cluster"
        deadline = time.monotonic() + HANG_S
        while not address_file.exists():
            assert nodes[0].poll() is None and time.monotonic() < deadline, (
                tmp_path / "head.log"
            ).read_text()
            time.sleep(0.2)
        address = address_file.read_text().strip()
        second = [f"--address={address}", "--num-cpus=1", f"--temp-dir={temp / 'node2'}"]
        nodes.append(ray_start(tmp_path / "node2.log", *second))
        waited = subprocess.run(
            [sys.executable, "-c", WAIT_FOR_NODES, address], env={**os.environ, **NO_TOKEN},
            capture_output=True, text=True, timeout=HANG_S,
        )  # fmt: skip
        assert waited.stdout.strip() == "2", (
            waited.stdout + waited.stderr + (tmp_path / "node2.log").read_text()
        )

        out = tmp_path / "out"
        env = {k: v for k, v in driver_env("", **{FAULT_ENV: "slow=1.5"}).items() if k != "RAY_ADDRESS"}
        command = [sys.executable, "-m", "bm", "run", str(prompts), "-o", str(out), *COMMON]
        command += ["--ray", "--replicas", "2", "--replica-threads", "1", "--block-lines", "4"]
        done = subprocess.run(
            command, env={**env, "RAY_TMPDIR": str(temp)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=HANG_S,
        )  # fmt: skip
    finally:
        for node in reversed(nodes):
            stop_node(node)
        shutil.rmtree(temp, ignore_errors=True)
    assert done.returncode == 0, done.stdout[-3000:]
    assert f"Connecting to existing Ray cluster at address: {address}" in done.stdout  # the head's
    rows = records(out)
    assert [r["index"] for r in rows] == list(range(n)) and by_index(rows) == expected
    by_replica = json.loads((out / "summary.json").read_text())["parallel"]["ray"]["blocks_by_replica"]
    assert sum(by_replica.values()) == n // 4
    assert len({name.split(" on node ")[1] for name in by_replica}) == 2, by_replica


TP_LINES = 24
# One replica of two ranks (a torch thread each: the cluster's 2 CPUs), blocks of 8 lines.
TP_FLAGS = [
    "--ray",
    "--replicas",
    "1",
    "--replica-threads",
    "1",
    "--tensor-parallel",
    "2",
    "--block-lines",
    "8",
]


@pytest.fixture(scope="module")
def tp_reference(tmp_path_factory, tiny_reference):
    """The tiny model as a checkpoint (ranks load their shards from one), 24 token-id lines (every third
    samples) and their records from a one-process ``bm run`` of that checkpoint."""
    folder = tmp_path_factory.mktemp("tp")
    checkpoint = folder / "ckpt"
    tiny_reference.save_pretrained(checkpoint)
    prompts = folder / "p.jsonl"
    with prompts.open("w") as f:
        for i in range(TP_LINES):
            row = {"input_ids": [3 + (7 * i + j) % 200 for j in range(2 + i % 9)], "max_tokens": 6}
            if i % 3 == 1:
                row["temperature"] = 0.9
            f.write(json.dumps(row) + "\n")
    args = ["run", str(prompts), *COMMON, "--model", str(checkpoint)]
    result = runner.invoke(app, [*args, "-o", str(folder / "one")])
    assert result.exit_code == 0, result.output
    return args[1:], str(checkpoint), by_index(records(folder / "one"))


def ranks_of(checkpoint: str) -> list[int]:
    """The pids of live ``bm.distributed.worker`` ranks serving ``checkpoint`` (their spec names it): this
    test's ranks alone, whatever else runs on the machine."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if (
                b"bm.distributed.worker" in (proc / "cmdline").read_bytes()
                and checkpoint.encode() in (proc / "environ").read_bytes()
            ):
                pids.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return pids


def no_ranks_left(checkpoint: str, within_s: float = 20.0) -> bool:
    """Every rank of the run exits with its replica (Ray ends the actors as the run ends)."""
    deadline = time.monotonic() + within_s
    while ranks_of(checkpoint):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")
def test_a_tensor_parallel_replica_gives_the_records_of_one_process(cluster, tp_reference, tmp_path):
    args, checkpoint, expected = tp_reference
    out = tmp_path / "out"
    result = bm_run(cluster, [*args, "-o", str(out), *TP_FLAGS])
    assert result.returncode == 0, result.stdout[-3000:]
    assert "on 1 replica(s) of 2 tensor-parallel ranks each" in " ".join(result.stdout.split())
    rows = records(out)
    assert [r["index"] for r in rows] == list(range(TP_LINES)) and by_index(rows) == expected
    ray_report = json.loads((out / "summary.json").read_text())["parallel"]["ray"]
    assert (ray_report["replicas"], ray_report["tensor_parallel"], ray_report["num_cpus_per_replica"]) == (
        1,
        2,
        2.0,
    )
    assert ray_report["num_replica_restarts"] == 0
    stats = [json.loads(line) for line in (out / "stats.jsonl").read_text().splitlines()]
    assert stats and all(s["TP Size"] == 2 for s in stats)  # the replica's engine drove two ranks
    assert no_ranks_left(checkpoint)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")
def test_a_killed_rank_restarts_its_replica_and_its_blocks_are_retried_not_given_error_records(
    cluster, tp_reference, tmp_path
):
    """Rank 1 killed mid-run: rank 0 (the actor) exits instead of answering its lines with errors, Ray
    restarts it with new ranks and retries its blocks, and every line still gets the one-process record."""
    args, checkpoint, expected = tp_reference
    out = tmp_path / "out"
    fault = {FAULT_ENV: f"kill_rank=8:{tmp_path / 'killed-once'}"}
    result = bm_run(cluster, [*args, "-o", str(out), *TP_FLAGS], **fault)
    assert result.returncode == 0, result.stdout[-3000:]
    text = " ".join(result.stdout.split())
    assert "kills its rank 1" in text and "exiting, so that the work it held is retried" in text
    assert "was restarted after its process died; Ray retried its unfinished block(s)" in text
    rows = records(out)
    assert [r["index"] for r in rows] == list(range(TP_LINES)) and by_index(rows) == expected
    ray_report = json.loads((out / "summary.json").read_text())["parallel"]["ray"]
    assert ray_report["num_replica_restarts"] >= 1 and ray_report["num_blocks_failed"] == 0
    assert no_ranks_left(checkpoint)


@pytest.mark.parametrize(
    ("flags", "fix"),
    [
        (["--data-parallel", "2"], "give --replicas 2 instead of --data-parallel"),
        (["--tensor-parallel", "2"], "--tensor-parallel needs model.path (a checkpoint directory)"),
        (["--tensor-parallel", "2", "--rank-timeout", "0"], "--rank-timeout is 0.0; give a positive number"),
    ],
)
def test_ray_refuses_what_its_replicas_cannot_run_naming_the_fix(tmp_path, flags, fix):
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    result = runner.invoke(app, ["run", str(prompts), "-o", str(tmp_path / "out"), *COMMON, "--ray", *flags])
    assert result.exit_code == 2 and fix in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()  # refused before anything starts
