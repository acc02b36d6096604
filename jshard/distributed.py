"""Multi-process and multi-host runs: JAX's own multi-controller runtime, and a local launcher.

Every process runs the same program. `initialize()` (called by every jshard entry point)
joins them through `jax.distributed.initialize`; afterwards `jax.devices()` lists the
devices of all processes, `jshard.make_mesh` builds one global mesh over them, and each
process feeds only the rows of the batch its own devices hold.

    one process (no cluster, no settings)         initialize() does nothing
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,   jax.distributed.initialize(those)
      JAX_PROCESS_ID (or the arguments)
    srun with more than one task, mpirun with     jax.distributed.initialize(), which reads
      more than one rank, JSHARD_DISTRIBUTED=1      SLURM / Open MPI / Kubernetes / TPU settings

`jshard launch -n N [--devices-per-process K] -- COMMAND...` runs N processes of COMMAND
on this machine, joined on a free port of 127.0.0.1, each with K fake CPU devices (JAX's
gloo CPU collectives carry the cross-process traffic). Each output line is prefixed with
its process index; when a process fails, the launcher stops the others and returns that
process's exit code; Ctrl-C stops them all.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import jax
import numpy as np

from jshard.mesh import runs_on_cpu

# Read by jshard (JAX itself reads JAX_COORDINATOR_ADDRESS and JAX_LOCAL_DEVICE_IDS too).
COORDINATOR_ENV, PROCESSES_ENV, PROCESS_ID_ENV = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
# A process that stops answering (a lost host or link, a stopped process) is declared dead by
# JAX's coordination service after this long, and every process then ends; JAX's default, 100 s,
# left the others waiting in a collective for 88 s on a cut link.
HEARTBEAT_TIMEOUT_S = 20
FORCE_ENV = "JSHARD_DISTRIBUTED"  # "1": let jax.distributed.initialize() detect the cluster
SUPERVISED_ENV = "JSHARD_SUPERVISED"  # set in a process whose output a parent reads (`supervise`, `launch`)
LAUNCH_GRACE_S = 5.0  # after SIGTERM, how long a stopped process has before SIGKILL


class DistributedError(ValueError):
    """A multi-process run that cannot start as asked."""


# -- joining a multi-process run ---------------------------------------------------------


def _cluster() -> str | None:
    """The cluster launcher that started several processes of this program, if any.

    Only launchers of more than one process count: an `sbatch` script itself (one process,
    SLURM_JOB_ID set) or `mpirun -n 1` is a one-process run. Kubernetes and TPU pods are
    not guessed; JSHARD_DISTRIBUTED=1 asks JAX to detect them.
    """
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1:
        return "SLURM (srun)"
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "Open MPI (mpirun)"
    if os.environ.get(FORCE_ENV, "") not in ("", "0"):
        return f"{FORCE_ENV}={os.environ[FORCE_ENV]}"
    return None


def _int_setting(value, name: str, env: str) -> int | None:
    if value is None:
        value = os.environ.get(env) or None
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{name} must be an int, got {value!r} (argument or {env})") from None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None, timeout_s: int = 300) -> bool:
    """Join this process to a multi-process run; True if it is in one (now or before).

    A no-op returning False for one process. Otherwise `jax.distributed.initialize` with
    the coordinator address, process count and process id given here or in the
    environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), or detected
    from the cluster (SLURM's srun, Open MPI's mpirun; any of JAX's detectors with
    JSHARD_DISTRIBUTED=1). Call it before any JAX computation, on every process.
    """
    if jax.distributed.is_initialized():
        return True
    address = coordinator_address or os.environ.get(COORDINATOR_ENV) or None
    count = _int_setting(num_processes, "num_processes", PROCESSES_ENV)
    index = _int_setting(process_id, "process_id", PROCESS_ID_ENV)
    explicit = {"coordinator address": address, "process count": count, "process id": index}
    given = {k: v for k, v in explicit.items() if v is not None}
    cluster = _cluster()
    if count == 1 and not cluster:
        return False
    if given and len(given) < 3 and not cluster:
        missing = [k for k, v in explicit.items() if v is None]
        raise DistributedError(
            f"a multi-process run needs a coordinator address, a process count and a process id; "
            f"got only {', '.join(f'{k} {v!r}' for k, v in given.items())}. Fix: also set "
            f"{', '.join(missing)} ({COORDINATOR_ENV}=host:port, {PROCESSES_ENV}=N, {PROCESS_ID_ENV}=0..N-1), "
            "or start the processes with `jshard launch`, srun or mpirun."
        )
    if count is not None and count < 1:
        raise DistributedError(f"the process count must be at least 1, got {count}")
    if count is not None and index is not None and not 0 <= index < count:
        raise DistributedError(f"process id {index} of {count} processes: ids run 0..{count - 1}")
    if not given and not cluster:
        return False
    if problem := _gloo_address_problem(address):
        raise DistributedError(problem)
    try:
        jax.distributed.initialize(
            address, count, index, local_device_ids, initialization_timeout=timeout_s,
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
            # All three given: use them as they are, not what a cluster's environment says.
            cluster_detection_method="deactivate" if len(given) == 3 else None,
        )
    except (RuntimeError, ValueError) as e:
        where = f"coordinator {address}" if address else f"the coordinator of {cluster}"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(
            f"cannot join the multi-process run through {where}: {first}. Fix: start every process "
            f"within {timeout_s} s of the others, with the same address and process count and its own id; "
            "process 0 must be able to listen on the address's port; call jshard.initialize() before any "
            "JAX computation."
        ) from e
    return True


def _gloo_address_problem(address: str | None) -> str | None:
    """What JAX cannot tell is wrong before the first collective hangs or is refused: gloo (its
    CPU collectives) tells the other processes to connect to the address this host's name
    resolves to. Where that is a loopback address and the coordinator's is not (the processes are
    on more than one host; a default /etc/hosts line '127.0.1.1 <name>'), they connect to themselves."""
    if not address or not runs_on_cpu():  # (GPUs: NCCL finds its own interface)
        return None
    try:
        coordinator = ipaddress.ip_address(socket.gethostbyname(address.rsplit(":", 1)[0].strip("[]")))
        name = socket.gethostname()
        own = ipaddress.ip_address(socket.gethostbyname(name))
    except (OSError, ValueError):  # unresolvable: JAX's own error says so
        return None
    if coordinator.is_loopback or not own.is_loopback:  # one machine (jshard launch), or a routable name
        return None
    return (f"this host's name {name!r} resolves to {own}, a loopback address, which gloo (JAX's CPU collectives) "
            f"gives the other processes to connect to; with the coordinator at {address}, not a loopback address (the "
            f"processes are on more than one host), they would connect to themselves (Connection refused). Fix: make "
            f"{name!r} resolve to this host's address on the coordinator's network (an /etc/hosts line '<that "
            f"address> {name}'), on every host.")


def is_main_process() -> bool:
    """True on process 0 (the one that prints and writes shared files)."""
    return jax.process_index() == 0


def leave(code: int, traceback: bool = False, at_once: bool = False) -> int:
    """Exit code `code` now in a multi-process run, or `at_once` (after printing the exception
    being handled, with `traceback`); otherwise return it.

    A process that ends normally waits at JAX's shutdown barrier for the others; one that
    fails while the others wait in a collective would wait there for minutes. Leaving at
    once lets the launcher (or the cluster) see the failure and stop the others.
    """
    if at_once or (jax.distributed.is_initialized() and jax.process_count() > 1):
        if traceback:
            import traceback as tb

            tb.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


# -- one process of a multi-process run, under a parent that reads its output ---------------


def needs_supervisor() -> bool:
    """True for a command started as one process of a multi-process run (the settings or a
    cluster launcher say so) that no jshard parent watches yet (`supervise`, `launch`)."""
    if os.environ.get(SUPERVISED_ENV):
        return False
    count = os.environ.get(PROCESSES_ENV, "").strip()
    return _cluster() is not None or count not in ("", "0", "1")


def _dies_with_parent() -> None:  # (in the child, before it runs the command: Linux only)
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a killed supervisor leaves no process behind


def supervise(command: list[str], name: str, err=None) -> int:
    """Run `command` (this process's own jshard command) as a child and relay its output, for a
    process of a multi-process run: gloo's lines left out, and when JAX's runtime ends it for a
    lost process or coordinator, one line (`jshard NAME: ...`) in place of JAX's report (kept in
    `JAX_REPORT_LOG`). Returns the child's exit code (128 + signal when killed); SIGINT and
    SIGTERM go on to it. A process JAX aborts cannot print that line itself."""
    err = err or sys.stderr
    linux = sys.platform.startswith("linux")
    child = subprocess.Popen(command, env={**os.environ, SUPERVISED_ENV: "1", "PYTHONUNBUFFERED": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                             preexec_fn=_dies_with_parent if linux else None)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, _: child.send_signal(signum))
    index = os.environ.get(PROCESS_ID_ENV)
    outputs = {stream: ProcessOutput(index or "this process") for stream in ("stdout", "stderr")}
    readers = [threading.Thread(target=_relay, daemon=True, args=(
        outputs[stream], getattr(child, stream), lambda line, to=getattr(sys, stream): print(line, file=to, flush=True)))
        for stream in outputs]
    try:
        for reader in readers:
            reader.start()
        code = _exit_code(child.wait())
        for reader in readers:
            reader.join(timeout=5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    report = outputs["stderr"]
    if code and report.reported:
        me = f"process {index}" if index else "this process"
        address = os.environ.get(COORDINATOR_ENV)
        if report.lost:
            what = f"{lost_processes_line(report.lost)}, so JAX's runtime ended every process, {me} with it"
        elif report.lost_coordinator:
            what = (f"{me} lost JAX's coordination service{f' at {address}' if address else ''} (process 0, or the "
                    f"link to it), so JAX's runtime ended it")
        else:
            what = f"JAX's distributed runtime ended {me}"
        print(f"jshard {name}: {what}; {_describe(code)}. Fix: bring the host or link back, then start every "
              f"process again (with --resume to go on from the latest checkpoint). JAX's report: {JAX_REPORT_LOG}",
              file=err, flush=True)
    return code


# -- meshes over processes ---------------------------------------------------------------


def axes_across_processes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """The mesh axes along which devices of different processes (hosts) meet.

    `jshard.make_mesh` orders devices process by process, so inner axes (`tensor` first)
    stay inside a process while they fit in its devices, and the outer ones cross.
    """
    owner = np.vectorize(lambda d: d.process_index)(mesh.devices)
    crossing = []
    for i, name in enumerate(mesh.axis_names):
        first = np.take(owner, [0], axis=i)
        if (owner != first).any():
            crossing.append(name)
    return tuple(crossing)


# -- the local launcher ------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _exit_code(returncode: int) -> int:
    """A child's status as a shell shows it: killed by signal s -> 128 + s."""
    return 128 - returncode if returncode < 0 else returncode


def _describe(code: int) -> str:
    if code > 128:
        try:
            return f"exit code {code} (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def _child_env(index: int, processes: int, devices: int, address: str, base: dict | None) -> dict:
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env.update({
        COORDINATOR_ENV: address, PROCESSES_ENV: str(processes), PROCESS_ID_ENV: str(index),
        "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices), "XLA_FLAGS": " ".join(flags),
        "PYTHONUNBUFFERED": "1", SUPERVISED_ENV: "1",
    })
    for name in ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", FORCE_ENV):  # this launch is the cluster
        env.pop(name, None)
    return env


# gloo (JAX's CPU collectives) reports each communicator it connects, one line per process and
# communicator (38 for a short 2-process run), written from its own threads into the middle of
# other lines: a parent (the launcher, a supervisor) leaves them out and joins what they split.
GLOO_CONNECTED = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
                            r"Expected number of connected peer ranks is : \d+")
# Two of its threads may also write into each other's line, word by word: what is left of a
# line once these parts and the numbers between them are taken out was gloo's alone.
GLOO_PARTS = re.compile(r"\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :|\d+")
# JAX's distributed runtime ends a process that lost another (or the coordinator) with an absl
# report and a C++ stack (about 20 lines): from its first line on, a parent keeps what the process
# writes in a log (`JAX_REPORT_LOG`) and says in one line what happened.
JAX_REPORT = re.compile(r"^(F\d{4} |E\d{4} .*\b(coordination_service(_agent)?\.cc|client\.h):\d+\])")
JAX_REPORT_LOG = os.path.join(tempfile.gettempdir(), f"jshard-distributed-{os.getpid()}.log")


class ProcessOutput:
    """What a parent shows of one JAX process's output: `show(raw)` gives each raw line's text to
    print, or None for what is left out (gloo's lines; JAX's report of a lost process, which goes
    to `JAX_REPORT_LOG`). Reads from that report which processes were lost."""

    def __init__(self, name: str):
        self.name, self.before = name, ""  # before: what preceded a gloo line written into a line
        self.lost: set[int] = set()  # processes JAX's coordination service declared dead
        self.lost_coordinator = False  # this process's heartbeats to the coordinator failed
        self.reported = False  # JAX's report began: the rest goes to the log
        self._unhealthy = False  # the next line lists the processes that stopped sending heartbeats

    def show(self, raw: str) -> str | None:
        text = raw.rstrip("\r\n")
        if self._unhealthy:
            self.lost.update(int(n) for n in re.findall(r"\d+", text))
        self._unhealthy = "stopped sending heartbeats" in text
        self.lost_coordinator |= "CoordinationService/Heartbeat" in text
        if self.reported or JAX_REPORT.match(text):
            self.reported = True
            with open(JAX_REPORT_LOG, "a") as log:
                log.write(f"[{self.name}] {text}\n")
            return None
        line, gloo = self.before + text, 0
        while (cut := GLOO_CONNECTED.subn("", line))[1]:  # (one gloo line may split another)
            line, gloo = cut[0], gloo + cut[1]
        if gloo:  # the rest of the interrupted line comes next
            self.before = line
            return None
        self.before = ""
        if "[Gloo]" in line and not GLOO_PARTS.sub("", line).strip():  # gloo's lines spliced into each other
            return None
        return line

    def rest(self) -> str | None:
        """What was left of a line when the output ended."""
        rest, self.before = self.before or None, ""
        return rest


def lost_processes_line(lost: set[int]) -> str:
    return (f"process {', '.join(map(str, sorted(lost)))} stopped answering JAX's coordination service for "
            f"{HEARTBEAT_TIMEOUT_S} s (a lost host or link, or a stopped process)")


def _relay(output: ProcessOutput, pipe, write) -> None:
    """Each line of `pipe` that `output` shows, to `write`, until the pipe closes."""
    for raw in iter(pipe.readline, b""):
        if (line := output.show(raw.decode(errors="replace"))) is not None:
            write(line)
    if (rest := output.rest()) is not None:
        write(rest)
    pipe.close()


def _command(command: list[str]) -> list[str]:
    """`jshard ...` runs with this Python (the same jshard), wherever PATH points."""
    return [sys.executable, "-m", "jshard.cli", *command[1:]] if command[0] == "jshard" else list(command)


def launch(command: list[str], processes: int, devices_per_process: int | None = None, out=None, err=None,
           env: dict | None = None, grace_s: float = LAUNCH_GRACE_S) -> int:
    """Run `processes` copies of `command` joined as one multi-process JAX run on this machine.

    Each gets JAX_COORDINATOR_ADDRESS (a free port on 127.0.0.1), JAX_NUM_PROCESSES,
    JAX_PROCESS_ID and `devices_per_process` fake CPU devices (default 8 // processes, at
    least 1). Their output lines go to `out` prefixed `[i] `. Returns 0 when all succeed,
    else the first non-zero exit code (128 + signal for a killed process) after stopping
    the others (SIGTERM, then SIGKILL after `grace_s`). Ctrl-C (or SIGTERM) stops them all
    and returns 130 (143).
    """
    out, err = out or sys.stdout, err or sys.stderr
    if not isinstance(processes, int) or processes < 1:
        raise DistributedError(f"-n must be a positive int (processes), got {processes!r}")
    devices = devices_per_process if devices_per_process is not None else max(1, 8 // processes)
    if not isinstance(devices, int) or devices < 1:
        raise DistributedError(f"--devices-per-process must be a positive int, got {devices!r}")
    if not command:
        raise DistributedError("no command to launch. Fix: jshard launch -n 2 -- jshard train --steps 5")
    address = f"127.0.0.1:{free_port()}"
    lock = threading.Lock()

    def say(text: str) -> None:
        with lock:
            print(f"[launch] {text}", file=err, flush=True)

    outputs = [ProcessOutput(str(i)) for i in range(processes)]

    def printer(index: int):
        def write(line: str) -> None:
            with lock:
                print(f"[{index}] {line}", file=out, flush=True)
        return write

    say(f"{processes} process(es) × {devices} CPU device(s), coordinator {address}: {' '.join(command)}")
    children: list[subprocess.Popen] = []
    readers = []
    interrupted = {"signal": None}
    previous = {}

    def on_signal(signum, _frame):
        interrupted["signal"] = signum

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    first_failure = None
    try:
        for i in range(processes):
            child = subprocess.Popen(
                _command(command), env=_child_env(i, processes, devices, address, env), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,  # its own group
            )
            children.append(child)
            reader = threading.Thread(target=_relay, args=(outputs[i], child.stdout, printer(i)), daemon=True)
            reader.start()
            readers.append(reader)
        while True:
            if interrupted["signal"] is not None:
                sig = signal.Signals(interrupted["signal"])
                say(f"{sig.name}: stopping all processes")
                first_failure = 128 + sig.value
                break
            running = [c for c in children if c.poll() is None]
            failed = [(i, _exit_code(c.returncode)) for i, c in enumerate(children)
                      if c.returncode is not None and c.returncode != 0]
            if failed:
                index, first_failure = failed[0]
                if running:
                    say(f"process {index} failed with {_describe(first_failure)}; stopping the other(s)")
                break
            if not running:
                break
            time.sleep(0.05)
    except OSError as e:  # the command could not be started
        say(f"cannot start {command[0]!r}: {e}")
        first_failure = 127
    finally:
        _stop(children, grace_s)
        for reader in readers:
            reader.join(timeout=5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if first_failure is None:
        return 0
    for i, child in enumerate(children):
        say(f"process {i}: {_describe(_exit_code(child.returncode))}")
    if lost := set().union(*(o.lost for o in outputs)):
        say(f"{lost_processes_line(lost)}, so every process ended; JAX's reports: {JAX_REPORT_LOG}")
    elif any(o.reported for o in outputs):
        say(f"JAX's distributed runtime ended process {', '.join(o.name for o in outputs if o.reported)}; "
            f"its report: {JAX_REPORT_LOG}")
    return first_failure


def _stop(children: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to every running child's process group, SIGKILL to what is left after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        running = [c for c in children if c.poll() is None]
        for child in running:
            try:
                os.killpg(child.pid, sig)  # the group each child leads (start_new_session)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        for child in running:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
