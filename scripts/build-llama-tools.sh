#!/usr/bin/env bash
# The one llama.cpp build of this repository: compiles the llama.cpp sources vendored in the pinned,
# hash-checked llama-cpp-python sdist once, with the CPU flags of scripts/cpu_flags.py, as shared
# libraries (libllama, libggml*, libmtmd, ...: what llama-cpp-python loads; scripts/setup.sh copies
# them into the venv) plus the tools asked for (llama-server for setup, llama-batched-bench for the
# benchmarks), in one CMake unity build tree (scripts/llama-unity.cmake) cached by version + flags:
#   $GATEWAY_CACHE/llama.cpp-<version>-<key>/   sdist/ (hash-checked), src/, build/ (bin/ holds the
#   libraries and tools, RUNPATH $ORIGIN), build.log (all compiler output), built (targets done).
# A target already built is not built again; another one is built incrementally in the same tree.
# Prints the bin directory (last line of stdout); progress goes to stderr, one line per stage.
# Usage: build-llama-tools.sh [targets...]   (default llama-batched-bench; the libraries always)
#        build-llama-tools.sh --key         (prints the cache key of these flags and builds nothing)
# Environment: PYTHON, GATEWAY_CACHE, LLAMA_CMAKE_ARGS (default: scripts/cpu_flags.py),
#   LLAMA_BUILD_JOBS (default: nproc), LOG_PREFIX (default [llama.cpp]).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
CACHE=${GATEWAY_CACHE:-$HOME/.cache/routing-gateway}
LLAMA_VERSION=0.3.36  # as in scripts/setup.sh and requirements/llama.txt
LLAMA_CMAKE_ARGS=${LLAMA_CMAKE_ARGS:-$("$PYTHON" scripts/cpu_flags.py)}
JOBS=${LLAMA_BUILD_JOBS:-$(nproc)}
PREFIX=${LOG_PREFIX:-[llama.cpp]}
LIBRARIES="llama mtmd"  # what llama-cpp-python loads (ggml* come with llama)
TARGETS="$LIBRARIES ${*:-llama-batched-bench}"

say() { printf '%s %s\n' "$PREFIX" "$*" >&2; }
elapsed() { local s=$(( $(date +%s) - $1 )); if [ "$s" -ge 60 ]; then echo "$((s / 60))m$((s % 60))s"; else echo "${s}s"; fi; }

RECIPE=unity  # how the tree is built beyond the flags (scripts/llama-unity.cmake): part of the cache key
key=$(printf '%s %s %s' "$LLAMA_VERSION" "$LLAMA_CMAKE_ARGS" "$RECIPE" | sha256sum | cut -c1-16)
[ "${1:-}" != "--key" ] || { echo "$key"; exit 0; }  # the cache key only (scripts/build-image.sh seeds by it)
root="$CACHE/llama.cpp-$LLAMA_VERSION-$key"
bin="$root/build/bin"
log="$root/build.log"

artifact() { case " $LIBRARIES " in *" $1 "*) echo "$bin/lib$1.so" ;; *) echo "$bin/$1" ;; esac; }
missing=""
for target in $TARGETS; do
  if ! grep -qx "$target" "$root/built" 2>/dev/null || [ ! -e "$(artifact "$target")" ]; then
    missing="$missing $target"
  fi
done

if [ -n "$missing" ]; then
  mkdir -p "$root"
  if [ ! -f "$root/src/vendor/llama.cpp/CMakeLists.txt" ]; then
    if ! ls "$root"/sdist/llama_cpp_python-"$LLAMA_VERSION".tar.gz >/dev/null 2>&1; then
      "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        --require-hashes -r requirements/llama.txt -d "$root/sdist.tmp" >&2
      rm -rf "$root/sdist" && mv "$root/sdist.tmp" "$root/sdist"
    fi
    rm -rf "$root/src.tmp" && mkdir -p "$root/src.tmp"
    tar -xzf "$root/sdist/llama_cpp_python-$LLAMA_VERSION.tar.gz" -C "$root/src.tmp" --strip-components=1
    rm -rf "$root/src" && mv "$root/src.tmp" "$root/src"
  fi
  generator=()
  [ -f "$root/build/CMakeCache.txt" ] || ! command -v ninja >/dev/null || generator=(-G Ninja)
  say "building llama.cpp (${missing# }) with $LLAMA_CMAKE_ARGS, $JOBS jobs (log: $log)"
  start=$(date +%s)
  printf '\n=== %s: building%s with %s\n' "$(date -Is)" "$missing" "$LLAMA_CMAKE_ARGS" >>"$log"
  # Shared libraries, as llama-cpp-python's own wheel builds them (LLAMA_BUILD=ON: BUILD_SHARED_LIBS,
  # the common library, no curl), and the tools beside them in bin/, each finding the others there
  # (RUNPATH $ORIGIN): setup.sh copies bin/'s libraries and llama-server into the venv together.
  # shellcheck disable=SC2086
  if ! { cmake -S "$root/src/vendor/llama.cpp" -B "$root/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
           -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' \
           -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_UI=OFF \
           -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
           -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_UNITY_BUILD=ON "-DCMAKE_PROJECT_INCLUDE=$PWD/scripts/llama-unity.cmake" \
           $LLAMA_CMAKE_ARGS \
         && cmake --build "$root/build" --target $missing -j "$JOBS"; } >>"$log" 2>&1; then
    say "error: the llama.cpp build failed after $(elapsed "$start"); the end of $log:"
    tail -n 40 "$log" >&2
    exit 1
  fi
  for target in $missing; do echo "$target" >> "$root/built"; done
  say "llama.cpp built in $(elapsed "$start") (log: $log)"
else
  say "llama.cpp up to date ($TARGETS in $bin)"
fi
echo "$bin"
