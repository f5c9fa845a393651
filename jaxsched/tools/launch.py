"""Start one JAX process per host, locally or in an emulated cluster, and watch them.

The launcher (``launch``) sets, for each process::

    JAXSCHED_COORDINATOR_ADDRESS   host 0's address and a port, e.g. 127.0.0.1:47113
    JAXSCHED_NUM_PROCESSES         N
    JAXSCHED_PROCESS_ID            0 .. N-1
    JAXSCHED_GLOO_INTERFACE        the host's interface (only inside an emulated cluster)
    JAXSCHED_CPU_DEVICES           local CPU devices per process (only if asked for)
    JAXSCHED_HEARTBEAT_TIMEOUT     seconds until jax.distributed declares a silent peer dead

and the training script calls `initialize` before any other JAX call::

    import jaxsched.tools.launch
    info = jaxsched.tools.launch.initialize()      # jax.distributed.initialize(...) + gloo binding
    ...                                      # jax.process_index() == info.process_id

Without those variables (``srun``, ``mpirun``, a TPU pod's per-host start), ``initialize``
calls ``jax.distributed.initialize()`` with no addresses, which detects the cluster itself,
so the same script runs unchanged on a real cluster.

Failure handling: when a process exits non-zero (or is killed), the launcher stops the others
(SIGTERM to each process group, then SIGKILL after ``grace_s``) and returns the first failing
exit code. Processes that survive a dead peer on their own also fail: a gloo collective with a
crashed peer fails at once ("Connection closed by peer"), and jax.distributed's coordination
service declares a peer dead after ``heartbeat_timeout`` seconds (20 under this launcher,
100 by jax's default), after which every process aborts.

Shell (until ``jaxsched launch`` is wired into the CLI)::

    jaxsched launch --hosts 2 -- python train.py --steps 10
    jaxsched launch --hosts 2 --cluster --bandwidth 1gbit -- python train.py
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from types import TracebackType
from typing import IO, Any, Callable, Mapping, NamedTuple, Sequence

from jaxsched._errors import JaxschedError, JaxschedRuntimeError, JaxschedValueError

__all__ = [
    "bind_gloo",
    "DEFAULT_GRACE_S",
    "ENV_COORDINATOR",
    "ENV_CPU_DEVICES",
    "ENV_HEARTBEAT",
    "ENV_INIT_TIMEOUT",
    "ENV_INTERFACE",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_SHUTDOWN_TIMEOUT",
    "exit_now",
    "free_port",
    "GLOO_CHATTER",
    "GLOO_FACTORY",
    "GLOO_FACTORY_SIGNATURE",
    "GlooBindingError",
    "initialize",
    "launch",
    "LAUNCH_HEARTBEAT_TIMEOUT_S",
    "LAUNCH_INIT_TIMEOUT_S",
    "LAUNCH_SHUTDOWN_TIMEOUT_S",
    "LaunchError",
    "make_gloo_collectives",
    "ProcessInfo",
]

ENV_COORDINATOR = "JAXSCHED_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXSCHED_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXSCHED_PROCESS_ID"
ENV_INTERFACE = "JAXSCHED_GLOO_INTERFACE"
ENV_CPU_DEVICES = "JAXSCHED_CPU_DEVICES"
ENV_HEARTBEAT = "JAXSCHED_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "JAXSCHED_INIT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "JAXSCHED_SHUTDOWN_TIMEOUT"
_LAUNCH_VARS = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)

# Timeouts the launcher hands to jax.distributed (seconds). jax's defaults are 300/100/300:
# a peer that died would keep the others waiting minutes. The launcher stops them sooner
# anyway; these bound what a process does on its own.
LAUNCH_INIT_TIMEOUT_S = 60
LAUNCH_HEARTBEAT_TIMEOUT_S = 20
LAUNCH_SHUTDOWN_TIMEOUT_S = 120
DEFAULT_GRACE_S = 5.0

# --- gloo bound to an interface: the one place that touches jaxlib's private API ------------

# Verified on jax/jaxlib 0.10.2. jax's own CPU client factory (jax/_src/xla_bridge.py,
# make_cpu_client) calls this with distributed_client only, so gloo advertises the address
# the hostname resolves to; inside a network namespace that is loopback, which the peers
# cannot reach. Passing interface= makes gloo listen on, and advertise, that interface.
GLOO_FACTORY = "jax._src.lib._jax.make_gloo_tcp_collectives"
GLOO_FACTORY_SIGNATURE = (
    "make_gloo_tcp_collectives(distributed_client: jaxlib._jax.DistributedRuntimeClient, "
    "hostname: str | None = None, interface: str | None = None) -> jaxlib._jax.CpuCollectives"
)


class GlooBindingError(JaxschedError, RuntimeError):
    """jaxlib's private gloo factory is not what this module was written against.

    Raised before anything starts, so that a jax upgrade fails with the two signatures side by
    side instead of somewhere inside jaxlib.

    Example:
      >>> from jaxsched.tools import launch
      >>> issubclass(launch.GlooBindingError, RuntimeError)
      True
    """


def _gloo_factory():
    """jaxlib's gloo factory, after checking its signature against the pinned one."""
    try:
        from jax._src.lib import _jax
    except ImportError as err:  # pragma: no cover - jax layout changed
        raise GlooBindingError(
            f"cannot import jax._src.lib._jax ({err}); jaxsched binds gloo "
            f"to an interface through {GLOO_FACTORY}, verified on jax 0.10.2"
        ) from err
    factory = getattr(_jax, "make_gloo_tcp_collectives", None)
    doc = (getattr(factory, "__doc__", None) or "").strip().splitlines()
    found = doc[0] if doc else "<missing>"
    if factory is None or found != GLOO_FACTORY_SIGNATURE:
        import jax

        raise GlooBindingError(
            f"jaxsched binds gloo to a network interface through the private {GLOO_FACTORY}, "
            f"verified on jax 0.10.2 with signature\n  {GLOO_FACTORY_SIGNATURE}\n"
            f"but jax {jax.__version__} has\n  {found}\n"
            "Update jaxsched.tools.launch.make_gloo_collectives for this jax, or run without an "
            "interface (processes on one network namespace need none)."
        )
    return factory


def make_gloo_collectives(distributed_client, *, interface: str | None = None, hostname: str | None = None):
    """gloo TCP collectives over ``interface`` (e.g. ``eth0``) or ``hostname``'s address.

    The only call into ``jax._src.lib._jax.make_gloo_tcp_collectives`` in jaxsched; its
    signature is checked against `GLOO_FACTORY_SIGNATURE` and a mismatch raises
    `GlooBindingError` instead of failing somewhere inside jaxlib.

    Args:
      distributed_client: jax.distributed's client (after ``jax.distributed.initialize``).
      interface: the network interface gloo binds to (e.g. an emulated host's ``eth0``).
      hostname: bind to this name's address instead.

    Returns:
      jaxlib's ``CpuCollectives``, for ``make_cpu_client(collectives=...)``.

    Raises:
      GlooBindingError: jaxlib's factory differs from the pinned signature.

    Example:
      >>> from jax._src import distributed
      >>> from jaxsched.tools import launch
      >>> launch.make_gloo_collectives(distributed.global_state.client, interface="eth0")  # doctest: +SKIP
    """
    return _gloo_factory()(distributed_client=distributed_client, hostname=hostname, interface=interface)


def _check_cpu_client_factory():
    from jax._src import xla_bridge
    import inspect

    make = getattr(xla_bridge, "make_cpu_client", None)
    register = getattr(xla_bridge, "register_backend_factory", None)
    if make is None or register is None or "collectives" not in inspect.signature(make).parameters:
        raise GlooBindingError(
            "jaxsched replaces jax's CPU backend factory with one whose gloo collectives are "
            "bound to an interface: it needs jax._src.xla_bridge.make_cpu_client(collectives=...) "
            "and register_backend_factory, as in jax 0.10.2, and this jax differs"
        )
    return xla_bridge


def bind_gloo(interface: str) -> None:
    """Make the CPU client (not created yet) use gloo bound to ``interface``.

    Call after ``jax.distributed.initialize`` and before anything creates JAX's backends
    (``jax.devices()``, any computation). Re-registers jax's ``cpu`` backend factory with
    the same ``make_cpu_client``, passing collectives from `make_gloo_collectives`.

    Args:
      interface: the network interface gloo binds to: inside an emulated cluster the host's
        only link, so that gloo does not pick an address other hosts cannot reach.

    Raises:
      JaxschedRuntimeError: the backends exist already, jax.distributed is not initialized,
        or the CPU collectives are not gloo.
      GlooBindingError: this jax's private CPU client factory differs from the pinned one.

    Example:
      >>> import jax
      >>> from jaxsched.tools import launch
      >>> jax.distributed.initialize()  # doctest: +SKIP
      >>> launch.bind_gloo("eth0")  # doctest: +SKIP
    """
    from jax._src import config as jax_config, distributed

    xla_bridge = _check_cpu_client_factory()
    _gloo_factory()  # fail now, not when the backend is created
    if xla_bridge.backends_are_initialized():
        raise JaxschedRuntimeError(
            "bind_gloo must run before JAX creates its backends (before jax.devices() or any computation)"
        )
    if distributed.global_state.client is None:
        raise JaxschedRuntimeError("bind_gloo needs jax.distributed.initialize() to have run first")
    impl = jax_config.cpu_collectives_implementation.value
    if impl != "gloo":
        raise JaxschedRuntimeError(f"bind_gloo binds gloo, but jax_cpu_collectives_implementation is {impl!r}")

    def make_cpu_client():
        collectives = make_gloo_collectives(distributed.global_state.client, interface=interface)
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)


# --- in the training script --------------------------------------------------------------


class ProcessInfo(NamedTuple):
    process_id: int
    num_processes: int
    coordinator_address: str | None  # None when single-process
    interface: str | None  # gloo's interface, None when jax chose


def _env_int(name: str, value: int | float | None, default: int | None) -> int | None:
    if value is not None:
        return int(value)
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise JaxschedValueError(f"{name}={raw!r} is not an integer") from None


def _set_int(name: str) -> int:
    """The launch variable ``name``, known to be set (non-empty), as an int."""
    value = _env_int(name, None, None)
    assert value is not None  # the caller checked that ``name`` is set
    return value


def initialize(
    *,
    cpu_devices: int | None = None,
    interface: str | None = None,
    heartbeat_timeout_s: int | None = None,
    initialization_timeout_s: int | None = None,
    shutdown_timeout_s: int | None = None,
    allow_single_process: bool = False,
    fail_fast: bool = True,
) -> ProcessInfo:
    """``jax.distributed.initialize`` for a process started by `launch` or a real cluster.

    - Under ``jaxsched launch`` (``JAXSCHED_*`` variables set): initialize with the given
      coordinator, process count and id, and bind gloo to ``JAXSCHED_GLOO_INTERFACE`` if set.
    - Otherwise: ``jax.distributed.initialize()`` with no addresses, which auto-detects SLURM,
      Open MPI and TPU pods. If nothing is detected it raises, unless
      ``allow_single_process`` is set, in which case JAX runs as one process.

    Arguments override the environment. ``cpu_devices`` sets ``jax_num_cpu_devices``. Call it
    first, before any other JAX call.

    ``fail_fast``: an uncaught exception prints its traceback and ends the process at once
    (``os._exit(1)``). Without it, JAX's exit handler waits in jax.distributed's shutdown
    barrier for the other processes, which may be blocked in a collective that waits for this
    one, for up to the shutdown timeout (300 s by default). ``sys.exit(code)`` does not pass
    through this hook: a script that exits non-zero on purpose should call
    `exit_now` (or ``os._exit``).

    Args:
      cpu_devices: local CPU devices per process (``jax_num_cpu_devices``).
      interface: bind gloo to this network interface (default: ``JAXSCHED_GLOO_INTERFACE``).
      heartbeat_timeout_s: seconds until jax.distributed declares a silent peer dead.
      initialization_timeout_s: seconds to wait for every process to join.
      shutdown_timeout_s: seconds the shutdown barrier waits.
      allow_single_process: where no cluster is detected, run as one process instead of
        raising.
      fail_fast: end the process at once on an uncaught exception.

    Returns:
      ``ProcessInfo(process_id, num_processes, coordinator_address, interface)``.

    Raises:
      JaxschedRuntimeError: some ``JAXSCHED_*`` variables set but not all, or no cluster
        detected and ``allow_single_process`` not set.

    Example:
      In a training script, first thing:

      >>> from jaxsched.tools import launch
      >>> info = launch.initialize(allow_single_process=True)  # doctest: +SKIP
      >>> info.process_id, info.num_processes  # doctest: +SKIP
      (0, 1)
    """
    import jax

    cpu_devices = _env_int(ENV_CPU_DEVICES, cpu_devices, None)
    if cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    # jax's keyword -> seconds; each timeout is an int, though ``initialize`` types its
    # keywords apart (a dict of ints would not match its str ones)
    timeouts: dict[str, Any] = {}
    for key, env, arg in (
        ("initialization_timeout", ENV_INIT_TIMEOUT, initialization_timeout_s),
        ("heartbeat_timeout_seconds", ENV_HEARTBEAT, heartbeat_timeout_s),
        ("shutdown_timeout_seconds", ENV_SHUTDOWN_TIMEOUT, shutdown_timeout_s),
    ):
        value = _env_int(env, arg, None)
        if value is not None:
            timeouts[key] = value  # else jax's default
    interface = interface or os.environ.get(ENV_INTERFACE) or None

    present = [v for v in _LAUNCH_VARS if os.environ.get(v)]
    if present:
        missing = [v for v in _LAUNCH_VARS if v not in present]
        if missing:
            raise JaxschedRuntimeError(
                f"{', '.join(present)} set but {', '.join(missing)} missing: "
                "start the processes with jaxsched launch, or set all three"
            )
        coordinator = os.environ[ENV_COORDINATOR]
        num = _set_int(ENV_NUM_PROCESSES)
        pid = _set_int(ENV_PROCESS_ID)
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num,
            process_id=pid,
            cluster_detection_method="deactivate",
            **timeouts,
        )
    else:
        coordinator = None
        try:
            jax.distributed.initialize(**timeouts)
        except ValueError as err:
            if "should be defined" not in str(err):
                raise
            if allow_single_process:
                return ProcessInfo(0, 1, None, None)
            raise JaxschedRuntimeError(
                "jaxsched.tools.launch.initialize: no JAXSCHED_* variables and no cluster detected "
                f"by jax.distributed.initialize() ({err}). Start the script with `jaxsched "
                "launch --hosts N -- python ...`, under srun/mpirun/a TPU pod, or pass "
                "allow_single_process=True"
            ) from err
        from jax._src import distributed

        num, pid = distributed.global_state.num_processes, distributed.global_state.process_id
        coordinator = distributed.global_state.coordinator_address
    if interface:
        bind_gloo(interface)
    if fail_fast:
        _install_fail_fast()
    return ProcessInfo(pid, num, coordinator, interface)


def exit_now(code: int = 1) -> None:
    """Flush stdout/stderr and end the process with ``code``, skipping JAX's shutdown barrier.

    ``sys.exit`` runs JAX's exit handler, which waits in jax.distributed's shutdown barrier
    for peers that may themselves wait for this process; this does not.

    Args:
      code: the exit status.

    Example:
      >>> from jaxsched.tools import launch
      >>> launch.exit_now(3)  # doctest: +SKIP
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(code)


class _FailFastHook:
    """``sys.excepthook`` that runs the previous hook, then ends the process (`exit_now`)."""

    def __init__(self, previous: Callable[[type[BaseException], BaseException, TracebackType | None], object]):
        self.previous = previous

    def __call__(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:
            self.previous(exc_type, exc, tb)
        finally:
            exit_now(1)


def _install_fail_fast() -> None:
    if not isinstance(sys.excepthook, _FailFastHook):
        sys.excepthook = _FailFastHook(sys.excepthook)


# --- the launcher ------------------------------------------------------------------------


class LaunchError(JaxschedError, RuntimeError):
    """The processes could not be started.

    Example:
      >>> import jaxsched
      >>> from jaxsched.tools import launch
      >>> issubclass(launch.LaunchError, jaxsched.JaxschedError)
      True
    """


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now.

    Returns:
      The port (free when asked: another process may take it before the coordinator does).

    Example:
        >>> from jaxsched.tools import launch
        >>> 1024 <= launch.free_port() < 65536
        True
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: -SIGNAL becomes 128 + SIGNAL."""
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


#: Lines gloo prints once per connected peer when a process joins ("[Gloo] Rank 0 is
#: connected to 1 peer ranks. Expected number of connected peer ranks is : 1"): one per
#: process and collective context, noise unless something is wrong (``--verbose``).
GLOO_CHATTER = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")


def _pump(stream: IO[bytes], out: IO[str], tag: str, lock: threading.Lock, drop: re.Pattern | None = None) -> None:
    """Copy ``stream`` to ``out`` line by line, each line prefixed with ``tag``; lines that
    ``drop`` matches are left out."""
    try:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            if drop is not None and drop.search(line):
                continue
            if not line.endswith("\n"):
                line += "\n"
            with lock:
                out.write(tag + line)
                out.flush()
    except (OSError, ValueError):
        pass  # the launcher's own output went away: keep draining is not possible
    finally:
        stream.close()


class _Terminated(Exception):
    pass


def _raise_terminated(signum, frame):
    raise _Terminated(signum)


def launch(
    hosts: int,
    command: Sequence[str],
    *,
    cluster=None,
    port: int | None = None,
    cpu_devices: int | None = None,
    env: Mapping[str, str] | None = None,
    heartbeat_timeout_s: int = LAUNCH_HEARTBEAT_TIMEOUT_S,
    initialization_timeout_s: int = LAUNCH_INIT_TIMEOUT_S,
    shutdown_timeout_s: int = LAUNCH_SHUTDOWN_TIMEOUT_S,
    grace_s: float = DEFAULT_GRACE_S,
    timeout_s: float | None = None,
    prefix_output: bool = True,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: bool = True,
) -> int:
    """Run ``command`` as ``hosts`` processes; returns 0, or the first failing exit status.

    Each process gets the ``JAXSCHED_*`` variables (module docstring) and, with ``cluster``
    (a `jaxsched.tools.cluster.Cluster`), runs inside host ``i``'s namespace with gloo
    bound to its interface; without, all processes share loopback. Output lines are
    prefixed ``[rank] ``. When a process fails, the others get SIGTERM, then SIGKILL after
    ``grace_s``; the launcher returns within ``grace_s`` plus a fraction of a second.
    ``timeout_s`` bounds the whole run (exit status 124 when it expires). Ctrl-C or SIGTERM
    to the launcher stops every process (status 130 or 143). Unless ``verbose``, gloo's
    per-peer connection lines (`GLOO_CHATTER`) are left out.

    Args:
      hosts: how many processes.
      command: the argv each one runs (e.g. ``["python", "train.py"]``).
      cluster: a `jaxsched.tools.cluster.Cluster` with at least ``hosts`` hosts (None:
        loopback).
      port: the coordinator's port (None: a free one).
      cpu_devices: local CPU devices per process (``JAXSCHED_CPU_DEVICES``).
      env: more environment variables for every process.
      heartbeat_timeout_s: seconds until jax.distributed declares a silent peer dead.
      initialization_timeout_s: seconds for every process to join.
      shutdown_timeout_s: seconds the shutdown barrier waits.
      grace_s: seconds between SIGTERM and SIGKILL when stopping the others.
      timeout_s: bound on the whole run (None: none).
      prefix_output: prefix each output line with ``[rank] ``.
      stdout: where the processes' stdout goes (default ``sys.stdout``).
      stderr: where their stderr and the launcher's notes go (default ``sys.stderr``).
      verbose: keep gloo's per-peer connection lines.

    Returns:
      0, or the first failing exit status (124 on timeout, 130/143 when interrupted).

    Raises:
      JaxschedValueError: ``hosts`` not a positive integer, no command, or a cluster too small.

    Example:
      >>> import io, sys
      >>> from jaxsched.tools import launch
      >>> out = io.StringIO()
      >>> cmd = [sys.executable, "-c", "import os; print(os.environ['JAXSCHED_PROCESS_ID'])"]
      >>> launch.launch(2, cmd, stdout=out, stderr=io.StringIO())
      0
      >>> sorted(out.getvalue().splitlines())
      ['[0] 0', '[1] 1']
    """
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
        raise JaxschedValueError(f"hosts={hosts!r}: need an integer >= 1")
    command = list(command)
    if not command:
        raise JaxschedValueError("no command to launch: give it after `--`, e.g. -- python train.py")
    if cluster is not None and len(cluster.hosts) < hosts:
        raise JaxschedValueError(f"hosts={hosts} but the cluster {cluster.prefix!r} has {len(cluster.hosts)} hosts")
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    port = port or free_port()
    coordinator = f"{cluster.hosts[0].address if cluster is not None else '127.0.0.1'}:{port}"
    base = {
        **os.environ,
        **(env or {}),
        "PYTHONUNBUFFERED": "1",
        ENV_COORDINATOR: coordinator,
        ENV_NUM_PROCESSES: str(hosts),
        ENV_HEARTBEAT: str(heartbeat_timeout_s),
        ENV_INIT_TIMEOUT: str(initialization_timeout_s),
        ENV_SHUTDOWN_TIMEOUT: str(shutdown_timeout_s),
    }
    if cpu_devices is not None:
        base[ENV_CPU_DEVICES] = str(cpu_devices)

    def note(msg: str) -> None:
        with lock:
            err.write(f"jaxsched launch: {msg}\n")
            err.flush()

    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    status = 0
    in_main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _raise_terminated) if in_main else None
    try:
        try:
            for rank in range(hosts):
                proc_env = {**base, ENV_PROCESS_ID: str(rank)}
                argv = command
                if cluster is not None:
                    host = cluster.hosts[rank]
                    proc_env[ENV_INTERFACE] = host.interface
                    argv = host.exec_prefix() + command
                try:
                    p = subprocess.Popen(
                        argv,
                        env=proc_env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        start_new_session=True,
                    )
                except OSError as e:
                    raise LaunchError(f"cannot start {shlex.join(argv)}: {e}") from e
                procs.append(p)
                tag = f"[{rank}] " if prefix_output else ""
                drop = None if verbose else GLOO_CHATTER
                for stream, sink in ((p.stdout, out), (p.stderr, err)):
                    t = threading.Thread(target=_pump, args=(stream, sink, tag, lock, drop), daemon=True)
                    t.start()
                    pumps.append(t)
            status = _watch(procs, note, timeout_s)
        except KeyboardInterrupt:
            note("interrupted; stopping every process")
            status = 130
        except _Terminated:
            note("terminated; stopping every process")
            status = 143
        finally:
            _stop(procs, grace_s, note)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, old_term)
        for t in pumps:
            t.join(timeout=2.0)
    return status


def _watch(procs: list[subprocess.Popen], note, timeout_s: float | None) -> int:
    """Wait until every process exits 0 (0), one fails (its status) or time runs out (124).

    One waiter thread per process reports exits in the order they happen, so the failure
    reported is the first one, not the lowest rank among those that failed since the last look.
    """
    exits: queue.Queue = queue.Queue()
    for rank, p in enumerate(procs):
        threading.Thread(target=lambda r=rank, q=p: exits.put((r, q.wait())), daemon=True).start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    done = 0
    while done < len(procs):
        try:
            rank, code = exits.get(timeout=0.1)
        except queue.Empty:
            if deadline is not None and time.monotonic() > deadline:
                note(f"timed out after {timeout_s:g} s; stopping every process")
                return 124
            continue
        done += 1
        if code != 0:
            others = [r for r, q in enumerate(procs) if q.poll() is None]
            note(
                f"process {rank} {_describe(code)}"
                + (
                    f"; stopping process{'es' if len(others) > 1 else ''} {', '.join(map(str, others))}"
                    if others
                    else ""
                )
            )
            return _exit_status(code)
    return 0


def _stop(procs: list[subprocess.Popen], grace_s: float, note) -> None:
    """SIGTERM every running process group, SIGKILL what is left after ``grace_s``."""

    def signal_all(sig: int) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    if not any(p.poll() is None for p in procs):
        return
    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    if any(p.poll() is None for p in procs):
        note(f"killing what is still running after {grace_s:g} s")
        signal_all(signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
            note(f"process {p.pid} did not die")
