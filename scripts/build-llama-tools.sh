#!/usr/bin/env bash
# Builds llama.cpp's own tools (llama-batched-bench, llama-server) from the llama.cpp sources
# vendored in the pinned, hash-checked llama-cpp-python sdist, with the same CPU flags as
# scripts/setup.sh, into a cache keyed by version + flags. Prints the bin directory.
# Benchmarks use these tools as the speed ceiling of this machine. Usage: build-llama-tools.sh [targets...]
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
CACHE=${GATEWAY_CACHE:-$HOME/.cache/routing-gateway}
LLAMA_VERSION=0.3.36
LLAMA_CMAKE_ARGS=${LLAMA_CMAKE_ARGS:-$("$PYTHON" scripts/cpu_flags.py)}
TARGETS=${*:-llama-batched-bench}

key=$(printf '%s %s' "$LLAMA_VERSION" "$LLAMA_CMAKE_ARGS" | sha256sum | cut -c1-16)
root="$CACHE/llama-tools-$LLAMA_VERSION-$key"
missing=""
for target in $TARGETS; do [ -x "$root/build/bin/$target" ] || missing="$missing $target"; done
if [ -n "$missing" ]; then
  mkdir -p "$root"
  if [ ! -d "$root/src" ]; then
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --require-hashes -r requirements/llama.txt -d "$root/sdist" >&2
    mkdir -p "$root/src" && tar -xzf "$root"/sdist/llama_cpp_python-*.tar.gz -C "$root/src" --strip-components=1
  fi
  echo "[tools] building$missing with $LLAMA_CMAKE_ARGS (minutes on 2 cores)" >&2
  # shellcheck disable=SC2086
  cmake -S "$root/src/vendor/llama.cpp" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF $LLAMA_CMAKE_ARGS >/dev/null
  # shellcheck disable=SC2086
  cmake --build "$root/build" --target $missing -j2 >/dev/null
fi
echo "$root/build/bin"
