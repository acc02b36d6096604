"""Multi-process runs on one machine: processes on 127.0.0.1, each with fake CPU devices,
joined by `jax.distributed` and JAX's gloo CPU collectives (`jshard launch`).

Every child process has a timeout, so a hang fails a test instead of stalling CI.
"""

import contextlib
import io
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from jshard import distributed
from jshard.app import data
from jshard.cli import main
from jshard.distributed import DistributedError, initialize, launch
from jshard.app.train_config import TrainConfig
from jshard.app.training import train

LAUNCH = [sys.executable, "-m", "jshard.cli", "launch"]
TINY = dict(model="tiny", batch_size=8, seq_len=32, strategy="dp+fsdp+tp", mesh="data=2,fsdp=2,tensor=2")
TINY_FLAGS = ["--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--strategy", "dp+fsdp+tp",
              "--mesh", "data=2,fsdp=2,tensor=2"]
TIMEOUT_S = 240  # any one launched run; a deadlock fails the test instead of stalling CI


def run_launch(args, timeout=TIMEOUT_S):
    return subprocess.run(LAUNCH + args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def losses(path) -> list[float]:
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


# -- initialize ----------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_STEP_NUM_TASKS",
                 "OMPI_COMM_WORLD_SIZE", "JSHARD_DISTRIBUTED", "SLURM_JOB_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append((a, kw)))
    resolves(monkeypatch, "node7", "10.0.0.7")  # this host's name: routable (this machine's is loopback)
    return calls


def resolves(monkeypatch, name: str, address: str) -> None:
    """This host is `name`, resolving to `address`; other names resolve as IP literals do."""
    monkeypatch.setattr(socket, "gethostname", lambda: name)
    monkeypatch.setattr(socket, "gethostbyname", lambda host: address if host == name else str(ipaddress.ip_address(host)))


def test_one_process_is_a_no_op(clean_env, monkeypatch):
    assert initialize() is False
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
    assert initialize() is False
    # An sbatch script itself is one process, though SLURM says the job has 4 tasks.
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.delenv("JAX_NUM_PROCESSES")
    assert initialize() is False
    assert clean_env == []


def test_explicit_settings_go_to_jax(clean_env, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert initialize() is True
    (args, kwargs), = clean_env
    assert args == ("10.0.0.1:1234", 4, 3, None) and kwargs["cluster_detection_method"] == "deactivate"
    assert kwargs["heartbeat_timeout_seconds"] == distributed.HEARTBEAT_TIMEOUT_S  # a lost process ends the run in 20 s
    clean_env.clear()
    assert initialize("10.0.0.2:99", 2, 1) is True  # arguments win over the environment
    assert clean_env[0][0] == ("10.0.0.2:99", 2, 1, None)


@pytest.mark.parametrize("env", [{"SLURM_STEP_NUM_TASKS": "16"}, {"OMPI_COMM_WORLD_SIZE": "2"},
                                 {"JSHARD_DISTRIBUTED": "1"}])
def test_a_cluster_launcher_hands_over_to_jax_detection(clean_env, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert initialize() is True
    (args, kwargs), = clean_env
    assert args == (None, None, None, None) and kwargs["cluster_detection_method"] is None


@pytest.mark.parametrize("env, message", [
    ({"JAX_NUM_PROCESSES": "2"}, "got only process count 2. Fix: also set coordinator address, process id"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "ids run 0..1"),
    ({"JAX_NUM_PROCESSES": "two"}, "num_processes must be an int, got 'two'"),
])
def test_bad_settings_are_one_clear_error(clean_env, monkeypatch, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(DistributedError, match=message):
        initialize()
    assert clean_env == []


@pytest.mark.parametrize("own, coordinator, on_cpu, refused", [
    ("127.0.1.1", "10.0.0.1:1234", True, True),  # Debian's /etc/hosts line for the host's own name
    ("127.0.0.1", "127.0.0.1:1234", True, False),  # one machine, as jshard launch runs it
    ("10.0.0.2", "10.0.0.1:1234", True, False),  # a routable name
    ("127.0.1.1", "10.0.0.1:1234", False, False),  # GPUs: NCCL, not gloo, carries the collectives
])
def test_a_host_name_that_resolves_to_loopback_is_refused_before_joining(clean_env, monkeypatch, own, coordinator,
                                                                          on_cpu, refused):
    """gloo gives the other processes the address this host's name resolves to: a loopback one,
    with the coordinator elsewhere, has them connect to themselves (Connection refused)."""
    resolves(monkeypatch, "node7", own)
    monkeypatch.setattr(distributed, "runs_on_cpu", lambda: on_cpu)
    if refused:
        with pytest.raises(DistributedError, match=r"this host's name 'node7' resolves to 127.0.1.1, a loopback address, "
                                                   r".*Fix: make 'node7' resolve to this host's address"):
            initialize(coordinator, 2, 1)
        assert clean_env == []
    else:
        assert initialize(coordinator, 2, 1) is True and len(clean_env) == 1


def test_jax_failures_become_one_error_with_the_fix(monkeypatch):
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)

    def refuse(*a, **kw):
        raise RuntimeError("jax.distributed.initialize() must be called before any JAX computations")

    monkeypatch.setattr(jax.distributed, "initialize", refuse)
    with pytest.raises(DistributedError, match="cannot join the multi-process run through coordinator h:1: "
                                               "jax.distributed.initialize.. must be called before"):
        initialize("h:1", 2, 0)


# -- the launcher, with plain commands ---------------------------------------------------


def test_launch_sets_each_process_up_and_prefixes_its_lines():
    script = ("import os; e = os.environ; print('hello', e['JAX_PROCESS_ID'], e['JAX_NUM_PROCESSES'], "
              "e['JAX_NUM_CPU_DEVICES'], e['JAX_PLATFORMS'], e['JAX_COORDINATOR_ADDRESS'].split(':')[0]); "
              "print('second line')")
    out, err = io.StringIO(), io.StringIO()
    assert launch([sys.executable, "-c", script], 3, 2, out=out, err=err) == 0
    lines = out.getvalue().splitlines()
    for i in range(3):
        assert f"[{i}] hello {i} 3 2 cpu 127.0.0.1" in lines and f"[{i}] second line" in lines
    assert len(lines) == 6


def test_launch_leaves_out_gloos_lines_and_joins_what_they_split():
    gloo = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    script = (f"import sys; w = sys.stdout.write; w('{gloo}\\n'); w('jshard train: GPT '); w('{gloo}\\n'); "
              f"w('{gloo[:50]}'); w('{gloo}\\n'); w('{gloo[50:]}\\n'); w('tiny on corpus.txt\\n'); w('last')")
    out = io.StringIO()
    assert launch([sys.executable, "-c", script], 1, 1, out=out, err=io.StringIO()) == 0
    assert out.getvalue().splitlines() == ["[0] jshard train: GPT tiny on corpus.txt", "[0] last"]


def test_launch_leaves_out_two_gloo_lines_spliced_into_each_other():
    """Two of gloo's threads writing at once, as seen in a two-process `jshard train` run."""
    spliced = ("[Gloo] Rank [Gloo] Rank 23 is connected to  is connected to 33 peer ranks.  peer ranks. Expected "
               "number of connected peer ranks is : Expected number of connected peer ranks is : 33")
    script = f"import sys; w = sys.stdout.write; w('{spliced}\\n'); w('jshard train: 3 ranks\\n')"
    out = io.StringIO()
    assert launch([sys.executable, "-c", script], 1, 1, out=out, err=io.StringIO()) == 0
    assert out.getvalue().splitlines() == ["[0] jshard train: 3 ranks"]


def test_a_failed_process_stops_the_others(tmp_path):
    # Process 1 fails after a second; process 0 would sleep for 2 minutes.
    script = textwrap.dedent(f"""
        import os, sys, time
        i = os.environ['JAX_PROCESS_ID']
        open(os.path.join({str(tmp_path)!r}, 'pid' + i), 'w').write(str(os.getpid()))
        if i == '1':
            time.sleep(1); sys.exit(3)
        time.sleep(120)
    """)
    begin = time.monotonic()
    run = run_launch(["-n", "2", "--", sys.executable, "-c", script], timeout=90)
    assert run.returncode == 3, run.stderr
    assert time.monotonic() - begin < 30
    assert "process 1 failed with exit code 3; stopping the other(s)" in run.stderr
    assert "process 0: exit code 143 (killed by SIGTERM)" in run.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid0").read_text()), 0)


def test_ctrl_c_stops_every_process(tmp_path):
    script = (f"import os, time; open(os.path.join({str(tmp_path)!r}, 'pid' + os.environ['JAX_PROCESS_ID']), 'w')"
              ".write(str(os.getpid())); print('ready', flush=True); time.sleep(120)")
    launcher = subprocess.Popen(LAUNCH + ["-n", "2", "--", sys.executable, "-c", script],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"pid{i}").exists() for i in range(2)) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int((tmp_path / f"pid{i}").read_text()) for i in range(2)]
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, err
    assert "SIGINT: stopping all processes" in err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("argv, message", [
    (["launch", "-n", "0", "--", "true"], "-n must be a positive int (processes), got 0"),
    (["launch", "-n", "2", "--devices-per-process", "0", "--", "true"], "--devices-per-process must be a positive"),
    (["launch", "-n", "2"], "no command to launch"),
])
def test_launch_refuses_bad_input(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_command_that_cannot_start_is_exit_127():
    err = io.StringIO()
    assert launch(["/nonexistent/jshard-command"], 2, 1, out=io.StringIO(), err=err) == 127
    assert "cannot start '/nonexistent/jshard-command'" in err.getvalue()


# -- real multi-process JAX runs -----------------------------------------------------------


@pytest.mark.slow
def test_two_processes_train_as_one_and_checkpoints_cross_process_counts(tmp_path):
    """2 processes × 4 fake devices under dp+fsdp+tp = 1 process × 8; checkpoints both ways.
    The data is a memory-mapped token file, which each process reads only its rows of, and
    each evaluates its rows of the held-out split."""
    tokens = tmp_path / "tokens.bin"
    data.corpus_tokens().astype(np.uint16).tofile(tokens)
    # One process, 8 devices (this test process): steps 1-4, checkpoints at 2 and 4.
    alone = train(TrainConfig.of(**TINY, data=str(tokens), eval_every=2, steps=4, checkpoint_dir=str(tmp_path / "one"),
                              checkpoint_every=2), out=io.StringIO())
    one = alone.losses

    # Two processes: the same run.
    run = run_launch(["-n", "2", "--devices-per-process", "4", "--", "jshard", "train", *TINY_FLAGS,
                      "--data", str(tokens), "--eval-every", "2",
                      "--steps", "4", "--checkpoint-dir", str(tmp_path / "two"), "--checkpoint-every", "2",
                      "--metrics", str(tmp_path / "two.jsonl"), "--log-every", "1"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    two = losses(tmp_path / "two.jsonl")
    np.testing.assert_allclose(two, one, rtol=1e-6)
    evaluated = [json.loads(line) for line in (tmp_path / "two.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([r["eval_loss"] for r in evaluated if "eval_loss" in r],
                               [alone.eval_losses[2], alone.eval_losses[4]], rtol=1e-6)
    lines = run.stdout.splitlines()
    assert "[Gloo]" not in run.stdout + run.stderr
    assert ("[0]   devices     8 × cpu, mesh data=2 stage=1 fsdp=2 context=1 expert=1 tensor=2, 2 processes × 4 devices, "
            "across processes: data") in lines
    assert sum(line.startswith("[0] step ") for line in lines) == 4
    # Process 0 alone prints the run's report (the native runtime's lines aside), so compare
    # the report's lines only.
    by = {i: {line[4:] for line in lines if line.startswith(f"[{i}] ") and line[4:].strip()} for i in (0, 1)}
    report = {line for line in by[0] if re.match(r"(jshard |step |summary |  [a-z])", line)}
    assert len(report) > 4 and not report & by[1], sorted(by[1])

    # Written by 2 processes, resumed in 1: steps 3-4 as in the uninterrupted run.
    shutil.copytree(tmp_path / "two", tmp_path / "two_at_2")
    shutil.rmtree(tmp_path / "two_at_2" / "4")
    resumed = train(TrainConfig.of(**TINY, data=str(tokens), steps=4, checkpoint_dir=str(tmp_path / "two_at_2"),
                                resume=True), out=io.StringIO())
    assert resumed.first_step == 2
    np.testing.assert_allclose(resumed.losses, one[2:], rtol=1e-6)

    # Written by 1 process, resumed in 2.
    shutil.copytree(tmp_path / "one", tmp_path / "one_at_2")
    shutil.rmtree(tmp_path / "one_at_2" / "4")
    run = run_launch(["-n", "2", "--devices-per-process", "4", "--", "jshard", "train", *TINY_FLAGS,
                      "--data", str(tokens), "--steps", "4", "--checkpoint-dir", str(tmp_path / "one_at_2"), "--resume",
                      "--metrics", str(tmp_path / "one_at_2.jsonl")])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[0]   resumed     step 2 from" in run.stdout
    np.testing.assert_allclose(losses(tmp_path / "one_at_2.jsonl"), one[2:], rtol=1e-6)


def test_a_failing_process_leaves_at_once_instead_of_waiting_for_the_others():
    # Joined processes; process 1 fails while process 0 is busy. Without `leave`, process 1
    # would wait at JAX's shutdown barrier for process 0 (minutes) and the launch would hang.
    script = textwrap.dedent("""
        import os, sys, time
        import jax
        from jshard import distributed
        assert distributed.initialize()
        print('devices', jax.device_count(), 'local', jax.local_device_count(), flush=True)
        if jax.process_index() == 1:
            sys.exit(distributed.leave(3))
        time.sleep(120)
    """)
    begin = time.monotonic()
    run = run_launch(["-n", "2", "--devices-per-process", "2", "--", sys.executable, "-c", script], timeout=120)
    assert run.returncode == 3, run.stdout[-2000:] + run.stderr[-2000:]
    assert time.monotonic() - begin < 60
    assert "[1] devices 4 local 2" in run.stdout.splitlines()


def _children(pid: int) -> dict[int, int]:
    """{JAX_PROCESS_ID: pid} of the processes `pid` started (Linux /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            found[int(env[b"JAX_PROCESS_ID"])] = int(entry)
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the launched processes in /proc (Linux)")
@pytest.mark.parametrize("sig, said", [
    (signal.SIGKILL, "process 1: exit code 137 (killed by SIGKILL)"),
    # Stopped, not dead: only JAX's heartbeat (HEARTBEAT_TIMEOUT_S) tells the others, as for a lost host.
    (signal.SIGSTOP, f"process 1 stopped answering JAX's coordination service for {distributed.HEARTBEAT_TIMEOUT_S} s"),
], ids=["killed", "stopped"])
@pytest.mark.slow
def test_a_process_killed_or_stopped_mid_run_ends_the_launch_within_60_s(tmp_path, sig, said):
    metrics, out, err = tmp_path / "m.jsonl", tmp_path / "out", tmp_path / "err"
    with open(out, "w") as stdout, open(err, "w") as stderr:  # files: no pipe to fill up
        launcher = subprocess.Popen(
            LAUNCH + ["-n", "2", "--devices-per-process", "4", "--", "jshard", "train", *TINY_FLAGS,
                      "--steps", "100000", "--metrics", str(metrics)],
            stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    children = {}
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and launcher.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break  # training: past the compiling step
            time.sleep(0.2)
        assert launcher.poll() is None, out.read_text()[-3000:] + err.read_text()[-3000:]
        children = _children(launcher.pid)
        assert sorted(children) == [0, 1]
        os.kill(children[1], sig)
        signalled = time.monotonic()
        launcher.wait(timeout=60)
        took = time.monotonic() - signalled
    finally:  # whatever failed, leave nothing running (an exited launcher has reaped its processes)
        if launcher.poll() is None:
            for pid in _children(launcher.pid).values():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait(timeout=30)
    print(f"launcher exited {took:.2f} s after process 1 got {sig.name}")
    assert launcher.returncode != 0
    assert took < 60
    assert said in err.read_text(), err.read_text()
    for pid in children.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# -- one process of a multi-process run, supervised ----------------------------------------

# What JAX's runtime writes as it ends a process (jaxlib 0.10.2, a cut link, the stacks cut short):
# process 0, the coordinator, which lost process 1; process 1, which lost the coordinator.
JAX_ENDS = {
    0: """E1126 13:43:49.725310   14979 coordination_service.cc:1549] [12409168212850975006] Use error polling to propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']
F1126 13:43:49.726974   14990 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details.
RPC: /xla.coordination.CoordinationService/PollForError [type.googleapis.com/tensorflow.CoordinationServiceError='']
*** Check failure stack trace: ***
    @     0x7f589da40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
""",
    1: """F1126 13:43:49.744179   15000 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details.

RPC: /xla.coordination.CoordinationService/Heartbeat
*** Check failure stack trace: ***
    @     0x7f2863240634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
""",
}
GLOO_LINE = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"


def supervised(script: str, log: str = "", **env) -> subprocess.CompletedProcess:
    """`distributed.supervise` over `python -c script`, as `jshard` runs it: in a process of its own
    (the supervisor forks, which a process running JAX's threads must not)."""
    supervisor = (f"import sys; from jshard import distributed; distributed.JAX_REPORT_LOG = {log!r} or "
                  f"distributed.JAX_REPORT_LOG; sys.exit(distributed.supervise([sys.executable, '-c', {script!r}], 'train'))")
    return subprocess.run([sys.executable, "-c", supervisor], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env}, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("index, said", [
    (0, "jshard train: process 1 stopped answering JAX's coordination service for 20 s (a lost host or link, "
        "or a stopped process), so JAX's runtime ended every process, process 0 with it; exit code 134"),
    (1, "jshard train: process 1 lost JAX's coordination service at 10.77.0.1:9476 (process 0, or the link to it), "
        "so JAX's runtime ended it; exit code 134"),
])
def test_a_supervised_process_that_jax_ends_says_so_in_one_line(tmp_path, index, said):
    """The child prints a line and gloo's, then JAX's report, and aborts as JAX does."""
    (tmp_path / "report").write_text(JAX_ENDS[index])
    log = tmp_path / "jax.log"
    run = supervised(f"import os, sys; print('step 3 loss 5.5591'); print({GLOO_LINE!r}, flush=True); "
                     f"sys.stderr.write(open({str(tmp_path / 'report')!r}).read()); sys.stderr.flush(); os.abort()",
                     JAX_PROCESS_ID=str(index), JAX_COORDINATOR_ADDRESS="10.77.0.1:9476", log=str(log))
    assert run.returncode == 128 + signal.SIGABRT
    assert run.stdout.splitlines() == ["step 3 loss 5.5591"]
    assert run.stderr.splitlines() == [run.stderr.strip()] and run.stderr.startswith(said), run.stderr
    assert f"JAX's report: {log}" in run.stderr
    assert log.read_text().splitlines() == [f"[{index}] {line}" for line in JAX_ENDS[index].splitlines()]


def test_a_supervised_process_keeps_its_exit_code_and_its_own_lines():
    run = supervised("import sys; print('out'); print('jshard train: bad flag', file=sys.stderr); sys.exit(2)")
    assert (run.returncode, run.stdout, run.stderr) == (2, "out\n", "jshard train: bad flag\n")


@pytest.mark.parametrize("env, supervised", [
    ({}, False), ({"JAX_NUM_PROCESSES": "1"}, False), ({"JAX_NUM_PROCESSES": "2"}, True),
    ({"SLURM_STEP_NUM_TASKS": "4"}, True), ({"JAX_NUM_PROCESSES": "2", "JSHARD_SUPERVISED": "1"}, False),
])
def test_which_commands_run_under_a_supervisor(clean_env, monkeypatch, env, supervised):
    monkeypatch.delenv("JSHARD_SUPERVISED", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert distributed.needs_supervisor() == supervised


def test_axes_across_processes_of_a_one_process_mesh_is_empty():
    import jshard

    assert distributed.axes_across_processes(jshard.make_mesh(data=2, fsdp=2, tensor=2)) == ()


# -- two hosts: network namespaces joined by a veth ----------------------------------------

HOSTS = {"jshard-a": "10.77.0.1", "jshard-b": "10.77.0.2"}  # namespace -> its address on the link


def _ip(*args, namespace=None):
    command = ["ip", *(["netns", "exec", namespace, "ip"] if namespace else []), *args]
    return subprocess.run(command, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Two network namespaces, each its own host on a veth link (10.77.0.0/24). Each gets an
    /etc/netns hosts file that `ip netns exec` mounts over /etc/hosts: `routable=True` makes
    this machine's name resolve to that host's link address there, as on a cluster."""
    made = _ip("netns", "add", "jshard-a")
    if made.returncode:
        pytest.skip(f"network namespaces are not allowed here (ip netns add: {made.stderr.strip()})")
    try:
        _ip("netns", "add", "jshard-b")
        _ip("link", "add", "jshard-va", "type", "veth", "peer", "name", "jshard-vb")
        for (namespace, address), link in zip(HOSTS.items(), ("jshard-va", "jshard-vb")):
            _ip("link", "set", link, "netns", namespace)
            _ip("addr", "add", f"{address}/24", "dev", link, namespace=namespace)
            _ip("link", "set", link, "up", namespace=namespace)
            _ip("link", "set", "lo", "up", namespace=namespace)

        def routable(on: bool):
            for namespace, address in HOSTS.items():
                folder = f"/etc/netns/{namespace}"
                shutil.rmtree(folder, ignore_errors=True)
                if on:
                    os.makedirs(folder)
                    with open(f"{folder}/hosts", "w") as f:
                        f.write(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")

        yield routable
    finally:
        for namespace in HOSTS:
            _ip("netns", "del", namespace)  # (its end of the veth with it)
            shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)


def _on_two_hosts(tmp_path, name: str, steps: int) -> list[subprocess.Popen]:
    """`jshard train` as process 0 on host a (the coordinator) and process 1 on host b."""
    env = dict(JAX_COORDINATOR_ADDRESS=f"{HOSTS['jshard-a']}:9476", JAX_NUM_PROCESSES="2", JAX_NUM_CPU_DEVICES="4",
               JAX_PLATFORMS="cpu")
    return [subprocess.Popen(["ip", "netns", "exec", namespace, "env", *(f"{k}={v}" for k, v in env.items()),
                              f"JAX_PROCESS_ID={i}", sys.executable, "-m", "jshard.cli", "train", *TINY_FLAGS,
                              "--steps", str(steps), "--log-every", "1", "--metrics", str(tmp_path / f"{name}{i}.jsonl")],
                             stdout=open(tmp_path / f"{name}{i}.out", "w"), stderr=open(tmp_path / f"{name}{i}.err", "w"),
                             stdin=subprocess.DEVNULL)
            for i, namespace in enumerate(HOSTS)]


@pytest.mark.slow
def test_two_hosts_train_as_one_and_a_cut_link_ends_both_within_30_s_with_one_line(two_hosts, tmp_path):
    """Two processes, each in its own network namespace (its own host), over a veth: refused
    with the fix while the host name resolves to loopback; once it resolves to each host's
    link address, the losses are the one-process run's and gloo's lines are left out; the link cut
    mid-run ends both (JAX's heartbeat, `distributed.HEARTBEAT_TIMEOUT_S`) instead of leaving them
    waiting, each with one jshard line (its supervisor's) naming what was lost."""
    if ipaddress.ip_address(socket.gethostbyname(socket.gethostname())).is_loopback:
        two_hosts(False)
        for process in _on_two_hosts(tmp_path, "loopback", 2):
            assert process.wait(timeout=TIMEOUT_S) == 2
        for i in range(2):
            err = (tmp_path / f"loopback{i}.err").read_text().strip().splitlines()
            assert len(err) == 1 and "resolves to 127.0.0.1, a loopback address" in err[0], err
    two_hosts(True)
    processes = _on_two_hosts(tmp_path, "linked", 4)
    assert [p.wait(timeout=TIMEOUT_S) for p in processes] == [0, 0], (tmp_path / "linked0.err").read_text()[-3000:]
    alone = train(TrainConfig.of(**TINY, steps=4), out=io.StringIO())
    np.testing.assert_allclose(losses(tmp_path / "linked0.jsonl"), alone.losses, rtol=1e-6)
    assert "[Gloo]" not in (tmp_path / "linked0.out").read_text() + (tmp_path / "linked1.out").read_text()

    processes = _on_two_hosts(tmp_path, "cut", 100000)
    try:
        deadline, metrics = time.monotonic() + TIMEOUT_S, tmp_path / "cut0.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):  # training: past compiling
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), \
                (tmp_path / "cut0.err").read_text()[-3000:]
            time.sleep(0.2)
        _ip("link", "set", "jshard-va", "down", namespace="jshard-a")
        cut = time.monotonic()
        codes = [p.wait(timeout=60) for p in processes]
        took = time.monotonic() - cut
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"both processes ended {took:.1f} s after the link was cut, exit codes {codes}")
    assert all(code != 0 for code in codes) and took < 30
    said = [(tmp_path / f"cut{i}.err").read_text().splitlines() for i in range(2)]
    assert len(said[0]) == 1 and said[0][0].startswith("jshard train: process 1 stopped answering"), said[0]
    assert len(said[1]) == 1 and said[1][0].startswith("jshard train: process 1 lost JAX's coordination service "
                                                       f"at {HOSTS['jshard-a']}:9476"), said[1]
