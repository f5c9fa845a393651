"""An emulated multi-host cluster on one machine: network namespaces, a bridge, ``tc tbf``.

Each host is a network namespace ``{prefix}-h{i}`` with one interface, ``eth0``, holding a
private address ``{subnet}.{i+1}/24``. The hosts' links meet at a Linux bridge in a namespace
of its own, ``{prefix}-sw`` (the switch). Nothing is created in the machine's own namespace,
and no address exists outside the cluster's namespaces, so no traffic can leave them.

Bandwidth is shaped with ``tc qdisc ... tbf`` at both ends of every link: on the host's
``eth0`` (what the host sends) and on the switch port (what it receives), like a full-duplex
link of that rate into a non-blocking switch. Latency cannot be emulated here (``netem`` is
not available in this kernel, see docs/benchmarks.md); bandwidth can.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the ``ip``/``tc`` tools. Python::

    from jaxsched.tools.cluster import Cluster
    with Cluster.up(2, bandwidth="1gbit") as cluster:
        cluster.hosts[1].namespace, cluster.hosts[1].address, cluster.hosts[1].interface
    # torn down here, also on an exception, Ctrl-C or SIGTERM

Shell (``jaxsched cluster ...`` runs the same)::

    jaxsched cluster up --hosts 2 --bandwidth 1gbit
    jaxsched cluster status
    jaxsched cluster down        # also removes what a crashed run left behind
    jaxsched cluster set --bandwidth 100mbit   # while a job runs: every link
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

from jaxsched._errors import JaxschedError, JaxschedValueError

__all__ = [
    "BRIDGE",
    "Cluster",
    "ClusterError",
    "DEFAULT_PREFIX",
    "DEFAULT_SUBNET",
    "format_bandwidth",
    "Host",
    "INTERFACE",
    "list_namespaces",
    "MAX_HOSTS",
    "NotPrivilegedError",
    "parse_bandwidth",
    "parse_delay",
    "require_privileges",
    "set_links",
    "TBF_LATENCY",
    "teardown",
]

DEFAULT_PREFIX = "jxs"
DEFAULT_SUBNET = "10.199.0.0/24"
INTERFACE = "eth0"
BRIDGE = "br0"
MAX_HOSTS = 250
# tbf queue: how long a packet may wait before it is dropped. TCP adapts to drops; this only
# bounds the queue so a shaped link does not add seconds of buffering.
TBF_LATENCY = "50ms"

_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_RATE_SCALE = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9-]{0,19}$")
_UNSHAPED = ("none", "unlimited", "0")


class ClusterError(JaxschedError, RuntimeError):
    """The emulated cluster could not be brought up, found, or taken down.

    A `RuntimeError` too, so that scripts that catch ``RuntimeError`` around set-up keep working.

    Example:
      >>> import jaxsched
      >>> from jaxsched.tools import cluster
      >>> issubclass(cluster.ClusterError, (jaxsched.JaxschedError, RuntimeError))
      True
    """


class NotPrivilegedError(ClusterError):
    """Creating namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN).

    Its own class so that a caller can fall back to loopback without root, and still see
    every other set-up failure.

    Example:
      >>> from jaxsched.tools import cluster
      >>> issubclass(cluster.NotPrivilegedError, cluster.ClusterError)
      True
    """


@dataclass(frozen=True)
class Host:
    """One emulated host: run a process in it with ``ip netns exec {namespace} ...``.

    Attributes:
      rank: its index, the process id `jaxsched.tools.launch.launch` gives the process in it.
      namespace: its network namespace, ``{prefix}-h{rank}``.
      address: its private IPv4 address, reachable only from the cluster's namespaces.
      interface: its only link (bind gloo to it: `jaxsched.tools.launch.initialize`).

    Example:
      >>> from jaxsched.tools import cluster
      >>> cluster.Host(1, "jxs-h1", "10.199.0.2", "eth0").namespace
      'jxs-h1'
    """

    rank: int
    namespace: str
    address: str  # private IPv4 address, reachable only from the cluster's namespaces
    interface: str  # the host's only link (bind gloo to it: jaxsched.tools.launch.initialize)

    def exec_prefix(self) -> list[str]:
        """The argv prefix that runs a command inside this host's namespace.

        Returns:
          ``["ip", "netns", "exec", namespace]``: put the command after it.

        Example:
          >>> from jaxsched.tools import cluster
          >>> cluster.Host(0, "jxs-h0", "10.199.0.1", "eth0").exec_prefix() + ["hostname"]
          ['ip', 'netns', 'exec', 'jxs-h0', 'hostname']
        """
        return ["ip", "netns", "exec", self.namespace]


def parse_bandwidth(bandwidth: str | None) -> int | None:
    """``"1gbit"`` -> 10**9 bits/s; ``None``/``"none"``/``"unlimited"`` -> ``None`` (unshaped).

    Rates use ``tc``'s bit units: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` (powers of
    1000), as ``tc`` takes them, so a value passes through to ``tc`` unchanged.

    Args:
      bandwidth: the rate, or None/``"none"``/``"unlimited"``/``"0"`` for an unshaped link.

    Returns:
      Bits per second, or None for unshaped.

    Raises:
      JaxschedValueError: not a rate, or below ``tc``'s useful minimum of 8kbit.

    Example:
        >>> from jaxsched.tools import cluster
        >>> cluster.parse_bandwidth("1gbit"), cluster.parse_bandwidth("500mbit"), cluster.parse_bandwidth("none")
        (1000000000, 500000000, None)
    """
    if bandwidth is None:
        return None
    text = str(bandwidth).strip().lower()
    if text in _UNSHAPED:
        return None
    m = _RATE_RE.match(text)
    if not m:
        raise JaxschedValueError(
            f"bandwidth {bandwidth!r} is not a rate like '1gbit', '500mbit' or "
            f"'100kbit' (units bit, kbit, mbit, gbit, tbit; 'none' for unshaped)"
        )
    bits = float(m.group(1)) * _RATE_SCALE[m.group(2)]
    if bits < 8000:
        raise JaxschedValueError(f"bandwidth {bandwidth!r} is below tc's useful minimum of 8kbit")
    return int(bits)


def format_bandwidth(bits_per_s: int | None) -> str:
    if bits_per_s is None:
        return "unshaped"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        scale = _RATE_SCALE[unit]
        if bits_per_s >= scale and bits_per_s % (scale // 1000 or 1) == 0:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s}bit"


def _validate_hosts(hosts: int) -> int:
    if isinstance(hosts, bool) or not isinstance(hosts, int):
        raise JaxschedValueError(f"hosts={hosts!r}: need an integer >= 2")
    if not 2 <= hosts <= MAX_HOSTS:
        raise JaxschedValueError(f"hosts={hosts}: an emulated cluster has 2 to {MAX_HOSTS} hosts")
    return hosts


def _validate_prefix(prefix: str) -> str:
    if not _PREFIX_RE.match(prefix or ""):
        raise JaxschedValueError(
            f"prefix {prefix!r}: use lowercase letters, digits and '-', starting with a letter, at most 20 characters"
        )
    return prefix


def _validate_subnet(subnet: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(subnet, strict=True)
    except ValueError as err:
        raise JaxschedValueError(f"subnet {subnet!r}: {err}") from None
    if net.prefixlen != 24 or not net.is_private:
        raise JaxschedValueError(f"subnet {subnet!r}: need a private /24 such as {DEFAULT_SUBNET}")
    return net


def _have_net_admin() -> bool:
    """Whether this process may create namespaces and links: CAP_NET_ADMIN and CAP_SYS_ADMIN
    in its effective set (root has both, unless a container took them away)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    caps = int(line.split()[1], 16)
                    return all(caps & (1 << bit) for bit in (12, 21))  # NET_ADMIN, SYS_ADMIN
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0


def require_privileges() -> None:
    """Raise a clear error unless namespaces can be created here.

    Checked before anything is created, so that a run without root fails with what to do
    instead of half way through set-up.

    Raises:
      NotPrivilegedError: not root (CAP_NET_ADMIN and CAP_SYS_ADMIN).
      ClusterError: ``ip`` or ``tc`` (iproute2) missing.

    Example:
      >>> from jaxsched.tools import cluster
      >>> cluster.require_privileges()  # doctest: +SKIP
    """
    if not _have_net_admin():
        raise NotPrivilegedError(
            "an emulated cluster needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network "
            "namespaces and shape links with tc; run as root (e.g. sudo), or run without "
            "--cluster to use loopback"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"{' and '.join(missing)} not found: install iproute2")


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL
    )
    if check and proc.returncode != 0:
        raise ClusterError(
            f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def list_namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Namespaces that belong to the cluster ``prefix``: its hosts, then its switch.

    Args:
      prefix: the cluster's name prefix.

    Returns:
      ``["{prefix}-h0", ..., "{prefix}-sw"]``, hosts in rank order; ``[]`` when no such
      cluster is up.

    Example:
      >>> from jaxsched.tools import cluster
      >>> cluster.list_namespaces("jxs-doctest-none")  # doctest: +SKIP
      []
    """
    _validate_prefix(prefix)
    proc = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    pat = re.compile(rf"^{re.escape(prefix)}-(h(\d+)|sw)$")
    hosts = sorted((int(m.group(2)), n) for n in names if (m := pat.match(n)) and m.group(2))
    return [n for _, n in hosts] + [n for n in names if n == f"{prefix}-sw"]


def teardown(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove every namespace of the cluster ``prefix`` (idempotent); returns what was removed.

    Deleting a namespace deletes the veth ends and the bridge inside it, and with them the
    peers and qdiscs, so this also cleans up after a run that crashed half way through.

    Args:
      prefix: the cluster's name prefix.

    Returns:
      The namespaces removed (``[]`` when none was up).

    Raises:
      ClusterError: a namespace could not be removed.

    Example:
      >>> from jaxsched.tools import cluster
      >>> cluster.teardown("jxs-doctest-none")  # doctest: +SKIP
      []
    """
    removed, errors = [], []
    for name in list_namespaces(prefix):
        proc = _run(["ip", "netns", "delete", name], check=False)
        if proc.returncode == 0:
            removed.append(name)
        elif name in list_namespaces(prefix):
            errors.append(f"{name}: {proc.stderr.strip()}")
    if errors:
        raise ClusterError("could not remove " + "; ".join(errors))
    return removed


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """Within the block, SIGTERM/SIGHUP raise SystemExit so ``finally`` clauses run.

    (SIGINT already raises KeyboardInterrupt.) Only possible in the main thread; elsewhere
    the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


_DELAY_RE = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")


def parse_delay(delay: str | None) -> float | None:
    """``"5ms"`` -> 0.005 seconds; ``None``, ``"0"`` or ``"none"`` -> None (no added delay).

    Args:
      delay: a time with unit ``us``, ``ms`` or ``s``.

    Returns:
      Seconds, or None.

    Raises:
      JaxschedValueError: not a time.

    Example:
        >>> from jaxsched.tools import cluster
        >>> cluster.parse_delay("5ms"), cluster.parse_delay("250us"), cluster.parse_delay("0")
        (0.005, 0.00025, None)
    """
    if delay is None or str(delay).strip().lower() in _UNSHAPED:
        return None
    m = _DELAY_RE.match(str(delay).strip().lower())
    if not m:
        raise JaxschedValueError(f"delay {delay!r} is not a time like '5ms', '250us' or '0.1s'")
    seconds = float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]
    return seconds or None


def set_links(prefix: str = DEFAULT_PREFIX, bandwidth: str | None = None, delay: str | None = None) -> "Cluster":
    """Change every link of the running cluster ``prefix`` in place: both ends shaped to
    ``bandwidth`` (``"none"``: unshaped), and ``delay`` added one way at each end.

    Processes keep running and their TCP connections stay up: the qdiscs are replaced, not
    the links, so a job sees its network change between two packets (what a benchmark of
    re-planning needs). Delay needs the kernel's ``netem`` qdisc; where it is missing the
    call refuses before it changes anything.

    Args:
      prefix: the running cluster's name prefix.
      bandwidth: the new rate of every link end (None or ``"none"``: unshaped).
      delay: one-way delay added at every end (None: none).

    Returns:
      The cluster as it is now (it does not tear the cluster down on exit).

    Raises:
      ClusterError: no such cluster, or no ``netem`` for ``delay``.

    Example:
      >>> from jaxsched.tools import cluster
      >>> cluster.set_links("jxs", bandwidth="100mbit")  # doctest: +SKIP
      Cluster(prefix='jxs', hosts=2, bandwidth='100mbit')
    """
    bits = parse_bandwidth(bandwidth)
    seconds = parse_delay(delay)
    cluster = Cluster.attach(prefix)
    switch = f"{prefix}-sw"
    ends = [(h.namespace, h.interface) for h in cluster.hosts]
    ends += [(switch, f"p{h.rank}") for h in cluster.hosts]
    if seconds is not None:
        _check_netem(switch)
    for namespace, device in ends:
        if seconds is None:
            if bits is None:
                _run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], check=False)
            else:
                _run(_tbf(namespace, device, bits))
            continue
        # netem delays (and, with a rate, shapes) one direction at this end: half the delay
        # each way would need both; a one-way delay at every end adds ``delay`` per direction
        netem = [
            "tc",
            "-n",
            namespace,
            "qdisc",
            "replace",
            "dev",
            device,
            "root",
            "netem",
            "delay",
            f"{seconds * 1e6:.0f}us",
        ]
        _run(netem + ([] if bits is None else ["rate", f"{bits}bit"]))
    return Cluster(prefix, cluster.hosts, bits, owned=False)


def _check_netem(namespace: str) -> None:
    """Refuse, naming why, when the kernel cannot add delay (no ``sch_netem``)."""
    probe = f"jxdelay{os.getpid() % 10000}"
    _run(["ip", "-n", namespace, "link", "add", probe, "type", "veth", "peer", "name", probe + "p"])
    try:
        proc = _run(["tc", "-n", namespace, "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms"], check=False)
    finally:
        _run(["ip", "-n", namespace, "link", "delete", probe], check=False)
    if proc.returncode != 0:
        raise ClusterError(
            "this kernel has no netem qdisc (sch_netem), so delay cannot be "
            f"emulated here; bandwidth can (tc said: {proc.stderr.strip()})"
        )


def _tbf(namespace: str, device: str, bits_per_s: int) -> list[str]:
    # burst: at least one 64 KiB GSO segment plus a frame, or 1 ms of traffic at this rate.
    burst = max(64 * 1024 + 1514, bits_per_s // 8 // 1000)
    return [
        "tc",
        "-n",
        namespace,
        "qdisc",
        "replace",
        "dev",
        device,
        "root",
        "tbf",
        "rate",
        f"{bits_per_s}bit",
        "burst",
        str(burst),
        "latency",
        TBF_LATENCY,
    ]


class Cluster:
    """An emulated cluster of network namespaces. Build one with `up` or `attach`.

    As a context manager, the cluster `up` made is torn down on exit, also on an exception,
    Ctrl-C or SIGTERM (no namespace outlives the run); one from `attach` is left up.

    Args:
      prefix: the namespaces' name prefix.
      hosts: its hosts, in rank order.
      bandwidth: bits per second on every link end, None when unshaped.
      owned: whether ``__exit__`` tears it down.

    Example:
      >>> from jaxsched.tools import cluster
      >>> c = cluster.Cluster("jxs", [cluster.Host(0, "jxs-h0", "10.199.0.1", "eth0")], 10**9, owned=False)
      >>> c
      Cluster(prefix='jxs', hosts=1, bandwidth='1gbit')
    """

    def __init__(self, prefix: str, hosts: Sequence[Host], bandwidth: int | None, owned: bool = True):
        self.prefix = prefix
        self.hosts: tuple[Host, ...] = tuple(hosts)
        self.bandwidth = bandwidth  # bits/s on every link end, None when unshaped
        self.owned = owned  # whether __exit__ tears it down
        self._signal_guard: contextlib.ExitStack | None = None

    def __repr__(self) -> str:
        return (
            f"Cluster(prefix={self.prefix!r}, hosts={len(self.hosts)}, bandwidth={format_bandwidth(self.bandwidth)!r})"
        )

    @classmethod
    def up(
        cls, hosts: int, bandwidth: str | None = "1gbit", *, prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET
    ) -> "Cluster":
        """Create ``hosts`` namespaces joined by a bridge, links shaped to ``bandwidth``.

        Refuses if a cluster with this prefix exists already (``Cluster.attach`` uses it,
        ``teardown`` removes it). Anything created is removed again if set-up fails or is
        interrupted (Ctrl-C, SIGTERM).

        Args:
          hosts: how many hosts (1 to `MAX_HOSTS`).
          bandwidth: each link's rate each way (`parse_bandwidth`; None: unshaped).
          prefix: the namespaces' name prefix.
          subnet: the /24 the hosts' addresses come from.

        Returns:
          The cluster; use it in a ``with`` block so that it is torn down.

        Raises:
          NotPrivilegedError: not root.
          ClusterError: a cluster with this prefix is up already, or set-up failed.

        Example:
          >>> from jaxsched.tools import cluster
          >>> with cluster.Cluster.up(2, bandwidth="1gbit") as c:  # doctest: +SKIP
          ...     print(c.hosts[1].address)
          10.199.0.2
        """
        _validate_hosts(hosts)
        bits = parse_bandwidth(bandwidth)
        _validate_prefix(prefix)
        net = _validate_subnet(subnet)
        require_privileges()
        existing = list_namespaces(prefix)
        if existing:
            raise ClusterError(
                f"a cluster with prefix {prefix!r} exists already "
                f"({', '.join(existing)}); take it down first "
                f"(`jaxsched cluster down --prefix {prefix}`)"
            )
        addresses = list(net.hosts())
        switch = f"{prefix}-sw"
        members = [Host(i, f"{prefix}-h{i}", str(addresses[i]), INTERFACE) for i in range(hosts)]
        try:
            with _signals_raise():
                _run(["ip", "netns", "add", switch])
                _run(["ip", "-n", switch, "link", "add", BRIDGE, "type", "bridge"])
                _run(["ip", "-n", switch, "link", "set", BRIDGE, "up"])
                for h in members:
                    port = f"p{h.rank}"
                    _run(["ip", "netns", "add", h.namespace])
                    # Both ends are created directly inside their namespaces: nothing appears
                    # in the machine's own namespace, even for a moment.
                    _run(
                        [
                            "ip",
                            "link",
                            "add",
                            h.interface,
                            "netns",
                            h.namespace,
                            "type",
                            "veth",
                            "peer",
                            "name",
                            port,
                            "netns",
                            switch,
                        ]
                    )
                    _run(["ip", "-n", switch, "link", "set", port, "master", BRIDGE])
                    _run(["ip", "-n", switch, "link", "set", port, "up"])
                    _run(["ip", "-n", h.namespace, "link", "set", "lo", "up"])
                    _run(["ip", "-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", h.interface])
                    _run(["ip", "-n", h.namespace, "link", "set", h.interface, "up"])
                    if bits is not None:
                        _run(_tbf(h.namespace, h.interface, bits))
                        _run(_tbf(switch, port, bits))
        except BaseException:
            teardown(prefix)
            raise
        return cls(prefix, members, bits)

    @classmethod
    def attach(cls, prefix: str = DEFAULT_PREFIX) -> "Cluster":
        """The cluster ``prefix`` that is up now (e.g. from ``cluster up`` in a shell).

        The returned object does not tear the cluster down on ``__exit__``; ``down()`` does.

        Args:
          prefix: the cluster's name prefix.

        Returns:
          The cluster, its hosts and bandwidth read back from the namespaces.

        Raises:
          ClusterError: no such cluster is up, or it is incomplete.

        Example:
          >>> from jaxsched.tools import cluster
          >>> cluster.Cluster.attach("jxs").bandwidth  # doctest: +SKIP
          1000000000
        """
        names = [n for n in list_namespaces(prefix) if n != f"{prefix}-sw"]
        if not names:
            raise ClusterError(f"no cluster with prefix {prefix!r} is up (`jaxsched cluster up --hosts N`)")
        hosts, bits = [], None
        for rank, ns in enumerate(names):
            if ns != f"{prefix}-h{rank}":
                raise ClusterError(
                    f"cluster {prefix!r} is incomplete: expected {prefix}-h{rank}, "
                    f"found {ns}; take it down and bring it up again"
                )
            out = _run(["ip", "-n", ns, "-o", "-4", "addr", "show", "dev", INTERFACE]).stdout
            m = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
            if not m:
                raise ClusterError(f"{ns} has no IPv4 address on {INTERFACE}")
            hosts.append(Host(rank, ns, m.group(1), INTERFACE))
            qd = _run(["tc", "-n", ns, "qdisc", "show", "dev", INTERFACE]).stdout
            r = re.search(r"tbf .*?rate (\d+(?:\.\d+)?)([KMGT]?)bit", qd)
            if r:
                bits = int(float(r.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[r.group(2)])
        return cls(prefix, hosts, bits, owned=False)

    def down(self) -> list[str]:
        """Remove this cluster's namespaces (idempotent).

        Returns:
          The namespaces removed (`teardown`).

        Example:
          >>> from jaxsched.tools import cluster
          >>> cluster.Cluster.attach("jxs").down()  # doctest: +SKIP
          ['jxs-h0', 'jxs-h1', 'jxs-sw']
        """
        return teardown(self.prefix)

    def __enter__(self) -> "Cluster":
        self._signal_guard = contextlib.ExitStack()
        self._signal_guard.enter_context(_signals_raise())
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.owned:
                self.down()
        finally:
            if self._signal_guard is not None:
                self._signal_guard.close()
                self._signal_guard = None

    def describe(self) -> str:
        lines = [
            f"cluster {self.prefix!r}: {len(self.hosts)} hosts, "
            f"links {format_bandwidth(self.bandwidth)} each way, bridge in {self.prefix}-sw"
        ]
        lines += [f"  host {h.rank}: namespace {h.namespace}, {h.interface} {h.address}" for h in self.hosts]
        return "\n".join(lines)
