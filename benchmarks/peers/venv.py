"""The peers' packages, in an overlay venv the benchmark manages (``.venv-peers`` at the repository root).

Why an overlay: the peers must run inside the very SGLang the project's venv holds (same release, same torch, the
same CPU shims), and some of their wheels would pull other versions of packages that venv pins (torch, CUDA
wheels, numpy) or GPU-only packages. A second full SGLang venv costs ~7 GB and would be a different environment.
``python -m venv --system-site-packages`` cannot help: it exposes the *base interpreter's* site-packages, not
those of the venv it is run from. So the overlay is a plain venv (``--without-pip``) whose ``base.pth`` appends
the project venv's site-packages after its own: its interpreter sees SGLang and everything pinned there, plus the
peers. Peer packages are installed into it with ``--no-deps`` (their pure-Python dependencies named one by one)
under ``benchmarks/peers/constraints.txt``, by the project venv's pip (``pip --python``), and never when the base
already holds the same distribution at another version (``conflicts``): the overlay only adds, it never shadows
a pinned package. The servers and services of a peer run on the overlay's interpreter; the systems that need no
package (recompute, radix, file, kvtier) run on the project's.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from benchmarks.common import REPO

DEFAULT = REPO / ".venv-peers"
CONSTRAINTS = Path(__file__).with_name("constraints.txt")
_NORMALIZE = re.compile(r"[-_.]+")


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return _NORMALIZE.sub("-", name).lower()


def pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    """``name==version`` lines of a constraints file, by canonical name."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[canonical(name)] = version.strip()
    return out


def installed(site: Path) -> dict[str, str]:
    """Distributions in a site-packages directory (its ``*.dist-info``), by canonical name -> version."""
    out = {}
    if site.is_dir():
        for info in site.glob("*.dist-info"):
            meta = info / "METADATA"
            try:
                head = meta.read_text(errors="replace").split("\n\n", 1)[0]
            except OSError:
                continue
            fields = dict(line.split(": ", 1) for line in head.splitlines() if ": " in line)
            if "Name" in fields and "Version" in fields:
                out[canonical(fields["Name"])] = fields["Version"].strip()
    return out


def conflicts(wanted: dict[str, str], base: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Of ``wanted`` (name -> pinned version), those the base venv holds at another version: name -> (base, pin)."""
    return {n: (base[n], v) for n, v in wanted.items() if n in base and base[n] != v}


@dataclasses.dataclass
class PeersVenv:
    path: Path = DEFAULT
    base_python: Path = Path(sys.executable)

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    @property
    def site(self) -> Path:
        return self.path / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"

    @staticmethod
    def base_site() -> Path:
        """The project venv's site-packages (this interpreter's purelib)."""
        return Path(sysconfig.get_paths()["purelib"])

    def exists(self) -> bool:
        return self.python.exists() and (self.site / "base.pth").exists()

    def create(self) -> None:
        """Make the overlay (idempotent): a venv without pip, with ``base.pth`` naming the project venv's packages."""
        if not self.python.exists():
            subprocess.run([str(self.base_python), "-m", "venv", "--without-pip", str(self.path)], check=True,
                           capture_output=True, text=True)
        self.site.mkdir(parents=True, exist_ok=True)
        (self.site / "base.pth").write_text(f"{self.base_site()}\n")

    def installed(self) -> dict[str, str]:
        return installed(self.site)

    def missing(self, packages: tuple[str, ...]) -> list[str]:
        """Of ``packages`` (names, pinned in the constraints file), those not installed at their pin in the
        overlay or the base."""
        want, have = pins(), {**installed(self.base_site()), **self.installed()}
        return [p for p in packages if canonical(p) not in want or have.get(canonical(p)) != want[canonical(p)]]

    def install(self, packages: tuple[str, ...], timeout_s: float = 900.0) -> str | None:
        """Install ``packages`` at their pins with ``--no-deps`` into the overlay; None, or why it could not."""
        want = pins()
        unpinned = [p for p in packages if canonical(p) not in want]
        if unpinned:
            return f"not pinned in {CONSTRAINTS.name}: {', '.join(unpinned)}"
        wanted = {canonical(p): want[canonical(p)] for p in packages}
        bad = conflicts(wanted, installed(self.base_site()))
        if bad:
            return "would change packages the project venv pins: " + ", ".join(
                f"{n} {b} -> {v}" for n, (b, v) in sorted(bad.items()))
        todo = [f"{p}=={want[canonical(p)]}" for p in packages if canonical(p) not in installed(self.base_site())]
        if not todo:
            return None
        self.create()
        cmd = [str(self.base_python), "-m", "pip", "--python", str(self.python), "install", "--no-deps",
               "--disable-pip-version-check", "-c", str(CONSTRAINTS), *todo]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"pip install timed out after {timeout_s:.0f} s: {' '.join(todo)}"
        if done.returncode:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return f"pip install failed ({' '.join(todo)}): {' | '.join(tail)}"
        return None

    def versions(self, packages: tuple[str, ...]) -> dict[str, str]:
        """The installed version of each of ``packages`` (overlay first, then base), as the result records them."""
        have = {**installed(self.base_site()), **self.installed()}
        return {p: have.get(canonical(p), "not installed") for p in packages}

    def run(self, code: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """``code`` on the overlay's interpreter (an import check, a version query)."""
        return subprocess.run([str(self.python), "-c", code], capture_output=True, text=True, timeout=timeout_s)

    def import_check(self, modules: tuple[str, ...], timeout_s: float = 180.0) -> str | None:
        """None when every module imports on the overlay's interpreter, else the error's last line."""
        code = f"import importlib, json\nfor m in {json.dumps(list(modules))}:\n    importlib.import_module(m)\n"
        try:
            done = self.run(code, timeout_s)
        except subprocess.TimeoutExpired:
            return f"importing {', '.join(modules)} timed out"
        if done.returncode:
            lines = done.stderr.strip().splitlines()
            return f"import failed: {lines[-1] if lines else done.returncode}"
        return None
