"""The emulated cluster (jaxsched.tools.cluster) and the launcher (jaxsched.tools.launch).

Multi-process tests start at most 2 processes, each with 1 CPU device. Tests that create
network namespaces need root and are skipped without it.
"""

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxsched.tools import cluster as cluster_lib
from jaxsched.tools import launch as launch_lib
from jaxsched.tools.cli import _cluster as cli
from support import SUPPORT_DIR

HERE = Path(__file__).parent
ROOT = HERE.parent
WORKER = str(SUPPORT_DIR / "cluster_worker.py")
# The worker must import this checkout's jaxsched, whatever the venv has installed.
CHILD_ENV = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "JAX_PLATFORMS": "cpu"}
needs_root = pytest.mark.skipif(
    not cluster_lib._have_net_admin(), reason="creating network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
)


def _launch(mode, *args, hosts=2, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    kwargs.setdefault("grace_s", 1.0)
    kwargs.setdefault("timeout_s", 120)
    env = {**CHILD_ENV, **kwargs.pop("env", {})}
    t = time.monotonic()
    code = launch_lib.launch(
        hosts, [sys.executable, WORKER, mode, *map(str, args)], env=env, stdout=out, stderr=err, **kwargs
    )
    return code, out.getvalue(), err.getvalue(), time.monotonic() - t


# --- the pinned private gloo factory ---------------------------------------------------------


def test_gloo_factory_signature_is_the_pinned_one():
    from jax._src.lib import _jax

    factory = launch_lib._gloo_factory()
    assert factory is _jax.make_gloo_tcp_collectives
    assert factory.__doc__.splitlines()[0] == launch_lib.GLOO_FACTORY_SIGNATURE
    launch_lib._check_cpu_client_factory()  # make_cpu_client(collectives=...) still exists


def test_a_changed_gloo_factory_fails_clearly(monkeypatch):
    from jax._src.lib import _jax

    def make_gloo_tcp_collectives(distributed_client, hostname=None):
        """make_gloo_tcp_collectives(distributed_client: X, hostname: str | None = None) -> Y"""

    monkeypatch.setattr(_jax, "make_gloo_tcp_collectives", make_gloo_tcp_collectives)
    with pytest.raises(launch_lib.GlooBindingError, match="verified on jax 0.10.2") as exc:
        launch_lib.make_gloo_collectives(object(), interface="eth0")
    assert "hostname: str | None = None) -> Y" in str(exc.value)  # names what it found


# --- validation and privileges (no root needed) ----------------------------------------------


@pytest.mark.parametrize(
    "text,bits",
    [
        ("1gbit", 10**9),
        ("500mbit", 5 * 10**8),
        ("1.5GBIT", 15 * 10**8),
        ("100kbit", 10**5),
        ("none", None),
        (None, None),
    ],
)
def test_bandwidth_parses(text, bits):
    assert cluster_lib.parse_bandwidth(text) == bits


@pytest.mark.parametrize("bad", ["1gb", "fast", "-1gbit", "1 gbit", "gbit", "1e9bit", "10bit"])
def test_bad_bandwidth_is_named(bad):
    with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
        cluster_lib.parse_bandwidth(bad)


@pytest.mark.parametrize("hosts", [0, 1, 251, 2.0, "2"])
def test_bad_host_count_is_named(hosts):
    with pytest.raises(ValueError, match=f"hosts={hosts!r}"):
        cluster_lib.Cluster.up(hosts)


def test_bad_bandwidth_refused_before_anything_is_created(monkeypatch):
    monkeypatch.setattr(cluster_lib, "_run", lambda *a, **k: pytest.fail("ran a command"))
    with pytest.raises(ValueError, match="'1gb'"):
        cluster_lib.Cluster.up(2, "1gb")
    with pytest.raises(ValueError, match="subnet '192.168.7.0/16'"):
        cluster_lib.Cluster.up(2, subnet="192.168.7.0/16")
    with pytest.raises(ValueError, match="subnet '8.8.8.0/24'"):  # not private
        cluster_lib.Cluster.up(2, subnet="8.8.8.0/24")


def test_cluster_refuses_clearly_without_root(monkeypatch, capsys):
    monkeypatch.setattr(cluster_lib, "_have_net_admin", lambda: False)
    monkeypatch.setattr(cluster_lib, "_run", lambda *a, **k: pytest.fail("ran a command"))
    with pytest.raises(cluster_lib.NotPrivilegedError, match=r"needs root \(CAP_NET_ADMIN and CAP_SYS_ADMIN\)"):
        cluster_lib.Cluster.up(2, "1gbit")
    assert cli.run_cluster(["up", "--hosts", "2", "--bandwidth", "1gbit"]) == 1
    assert "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)" in capsys.readouterr().err
    assert cli.run_cluster(["down"]) == 1
    assert "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)" in capsys.readouterr().err
    assert cli.run_launch(["--hosts", "2", "--cluster", "--", "true"]) == 1
    assert "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)" in capsys.readouterr().err


def test_cli_input_errors(capsys):
    assert cli.run_cluster(["up", "--hosts", "1"]) == 2
    assert "hosts=1" in capsys.readouterr().err
    assert cli.run_cluster(["up", "--hosts", "2", "--bandwidth", "lots"]) == 2
    assert "'lots'" in capsys.readouterr().err
    assert cli.run_launch(["--hosts", "2"]) == 2
    assert "no command" in capsys.readouterr().err
    assert cli.run_launch(["--hosts", "2", "--bandwidth", "1gbit", "--", "true"]) == 2
    assert "need --cluster" in capsys.readouterr().err
    with pytest.raises(ValueError, match="hosts=0"):
        launch_lib.launch(0, ["true"])


def test_subcommands_plug_into_a_parent_parser(capsys, monkeypatch):
    """The contract for `jaxsched cluster ...` / `jaxsched launch ...`: add_arguments + main."""
    import argparse

    parser = argparse.ArgumentParser(prog="jaxsched")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_launch_arguments(sub.add_parser("launch"))
    cli.add_cluster_arguments(sub.add_parser("cluster"))
    args = parser.parse_args(["cluster", "up", "--hosts", "3", "--bandwidth", "500mbit"])
    assert (args.cluster_command, args.hosts, args.bandwidth) == ("up", 3, "500mbit")
    for var, value in CHILD_ENV.items():
        monkeypatch.setenv(var, value)
    args = parser.parse_args(["launch", "--hosts", "2", "--", sys.executable, WORKER, "echo"])
    assert cli.run_launch(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == ["[0] hello from 0 of 2", "[1] hello from 1 of 2"]


# --- initialize(): launcher variables, else jax's own cluster detection ----------------------


@pytest.fixture
def fake_distributed(monkeypatch):
    import jax

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    for var in [v for v in os.environ if v.startswith("JAXSCHED_")]:
        monkeypatch.delenv(var)
    return calls


def test_initialize_uses_the_launcher_variables(fake_distributed, monkeypatch):
    monkeypatch.setenv(launch_lib.ENV_COORDINATOR, "10.199.0.1:4321")
    monkeypatch.setenv(launch_lib.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(launch_lib.ENV_PROCESS_ID, "1")
    monkeypatch.setenv(launch_lib.ENV_HEARTBEAT, "20")
    info = launch_lib.initialize(fail_fast=False)
    assert info == launch_lib.ProcessInfo(1, 2, "10.199.0.1:4321", None)
    assert fake_distributed == [
        dict(
            coordinator_address="10.199.0.1:4321",
            num_processes=2,
            process_id=1,
            cluster_detection_method="deactivate",
            heartbeat_timeout_seconds=20,
        )
    ]


def test_initialize_falls_back_to_jax_cluster_detection(fake_distributed):
    info = launch_lib.initialize(fail_fast=False)
    assert fake_distributed == [{}]  # jax.distributed.initialize(): SLURM, Open MPI, TPU pods
    assert (info.process_id, info.num_processes) == (0, 1)  # the (unchanged) global state


def test_initialize_without_launcher_or_cluster(monkeypatch, fake_distributed):
    import jax

    def nothing_detected(**kw):
        raise ValueError("coordinator_address should be defined.")

    monkeypatch.setattr(jax.distributed, "initialize", nothing_detected)
    with pytest.raises(RuntimeError, match="no JAXSCHED_\\* variables and no cluster detected"):
        launch_lib.initialize(fail_fast=False)
    assert launch_lib.initialize(fail_fast=False, allow_single_process=True) == launch_lib.ProcessInfo(0, 1, None, None)


@pytest.mark.slow
def test_real_jax_without_any_cluster_runs_single_process_only_when_allowed():
    # In a fresh process (this one's backend exists already): pins the error jax raises when
    # it detects no cluster, which initialize() recognises.
    code = (
        "import jaxsched.tools.launch as l\n"
        "try:\n    l.initialize(fail_fast=False)\n"
        "except RuntimeError as e:\n    print('refused:', e)\n"
        "print(l.initialize(fail_fast=False, allow_single_process=True))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXSCHED_", "SLURM_", "OMPI_", "KUBERNETES_"))}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**env, **CHILD_ENV}, timeout=120, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "refused: jaxsched.tools.launch.initialize: no JAXSCHED_* variables and no cluster" in out.stdout
    assert "ProcessInfo(process_id=0, num_processes=1, coordinator_address=None" in out.stdout


def test_initialize_refuses_partial_launcher_variables(fake_distributed, monkeypatch):
    monkeypatch.setenv(launch_lib.ENV_COORDINATOR, "127.0.0.1:1")
    with pytest.raises(RuntimeError, match="JAXSCHED_NUM_PROCESSES, JAXSCHED_PROCESS_ID missing"):
        launch_lib.initialize(fail_fast=False)
    assert fake_distributed == []


# --- the launcher, over loopback -------------------------------------------------------------


def test_output_is_prefixed_by_rank():
    code, out, err, _ = _launch("echo")
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[0] hello from 0 of 2", "[1] hello from 1 of 2"]
    assert "[0] stderr line of 0" in err.splitlines() and "[1] stderr line of 1" in err.splitlines()


def test_a_failing_process_stops_the_others(tmp_path):
    pidfile = tmp_path / "rank0.pid"
    code, out, err, took = _launch("fail-sleep", pidfile, grace_s=5.0)
    assert code == 3, err
    assert took < 15
    assert "process 1 exited with code 3; stopping process 0" in err
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):  # rank 0 (sleeping 600 s) is gone
        os.kill(pid, 0)


@pytest.mark.slow
def test_a_crash_stops_a_peer_blocked_in_a_collective():
    # jax installs a SIGTERM handler (preemption notifier), so the blocked rank 0 survives
    # SIGTERM and is killed after grace_s.
    code, out, err, took = _launch("fail-collective")
    assert code == 3, err
    assert took < 60
    assert "process 1 exited with code 3; stopping process 0" in err


@pytest.mark.slow
def test_an_exception_does_not_wait_in_the_shutdown_barrier():
    # Without initialize()'s fail-fast hook, rank 1 would wait in jax.distributed's shutdown
    # barrier for rank 0, which waits in a psum for rank 1 (30 s and more).
    code, out, err, took = _launch("raise")
    assert code == 1, err
    assert "RuntimeError: rank 1 fails on purpose" in err
    assert "process 1 exited with code 1" in err
    assert took < 25


@pytest.mark.slow
def test_psum_over_loopback_with_gloo_bound_to_lo():
    code, out, err, _ = _launch("psum", env={launch_lib.ENV_INTERFACE: "lo"})
    assert code == 0, err
    assert "[0] psum 3 expected 3 interface lo" in out.splitlines()
    assert "[1] psum 3 expected 3 interface lo" in out.splitlines()


@pytest.mark.slow
def test_the_interface_reaches_gloo():
    code, out, err, _ = _launch("psum", env={launch_lib.ENV_INTERFACE: "jxsnosuch0"})
    assert code == 1
    assert "Unable to find address for: jxsnosuch0" in err  # gloo's own message


def test_launch_timeout():
    code, out, err, took = _launch("fail-sleep", hosts=1, timeout_s=1.0)  # rank 0 sleeps
    assert code == 124 and "timed out after 1 s" in err
    assert took < 10


# --- root only: real namespaces --------------------------------------------------------------

PREFIX = f"jxt{os.getpid() % 100000}"


@pytest.fixture
def no_leftovers():
    yield
    left = cluster_lib.list_namespaces(PREFIX)
    cluster_lib.teardown(PREFIX)
    assert left == [], f"left behind: {left}"


@needs_root
def test_cluster_up_attach_down(no_leftovers):
    c = cluster_lib.Cluster.up(2, "500mbit", prefix=PREFIX)
    try:
        assert [h.namespace for h in c.hosts] == [f"{PREFIX}-h0", f"{PREFIX}-h1"]
        assert [h.address for h in c.hosts] == ["10.199.0.1", "10.199.0.2"]
        for ns, dev in [(f"{PREFIX}-h0", "eth0"), (f"{PREFIX}-sw", "p1")]:
            qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "rate 500Mbit" in qdisc, qdisc
        attached = cluster_lib.Cluster.attach(PREFIX)
        assert attached.hosts == c.hosts and attached.bandwidth == 5 * 10**8
        with pytest.raises(cluster_lib.ClusterError, match="exists already"):
            cluster_lib.Cluster.up(2, prefix=PREFIX)
        # the machine's own namespace got nothing
        assert PREFIX not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    finally:
        assert c.down() == [f"{PREFIX}-h0", f"{PREFIX}-h1", f"{PREFIX}-sw"]
    assert c.down() == []  # idempotent


@needs_root
def test_a_failed_set_up_leaves_nothing(monkeypatch, no_leftovers):
    monkeypatch.setattr(
        cluster_lib, "_tbf", lambda ns, dev, bits: ["tc", "-n", ns, "qdisc", "add", "dev", dev, "bogus"]
    )
    with pytest.raises(cluster_lib.ClusterError, match="bogus"):
        cluster_lib.Cluster.up(2, "1gbit", prefix=PREFIX)
    assert cluster_lib.list_namespaces(PREFIX) == []


@needs_root
@pytest.mark.slow
def test_psum_between_two_namespaces(no_leftovers):
    with cluster_lib.Cluster.up(2, "1gbit", prefix=PREFIX) as c:
        code, out, err, _ = _launch("psum", cluster=c)
        assert cluster_lib.list_namespaces(PREFIX)
    assert code == 0, err
    assert "[0] psum 3 expected 3 interface eth0" in out.splitlines()
    assert "[1] psum 3 expected 3 interface eth0" in out.splitlines()
    assert cluster_lib.list_namespaces(PREFIX) == []
