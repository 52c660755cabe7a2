"""CMake flags for llama.cpp's CPU backend, chosen from the features this machine's CPU reports.

A `-DGGML_NATIVE=ON` build compiles with -march=native, which on recent Xeons includes the AMX
kernels; where the kernel does not grant AMX tile state (sandboxes, some VMs) every decode then
dies of SIGSEGV. A fixed feature list fails the other way: forced AVX-512 dies of an illegal
instruction on most laptops. So on x86-64 each feature is switched on only when /proc/cpuinfo
lists it, and AMX never; on other architectures (ARM) -march=native has no such trap.

Usage: python scripts/cpu_flags.py [--cpuinfo FILE] [--machine ARCH]   (prints one line)
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

# (cpuinfo flag, ggml option). With GGML_NATIVE=OFF ggml turns SSE4.2, AVX, AVX2, BMI2, FMA and F16C
# on by default, so a missing one must be switched off explicitly.
NAMED = [("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
         ("avx512f", "GGML_AVX512"), ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16")]
DEFAULT_ON = [("sse4_2", "GGML_SSE42"), ("bmi2", "GGML_BMI2")]  # named only when missing


def cpu_features(cpuinfo: str) -> set[str]:
    """The feature flags of the first processor in /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cmake_args(features: set[str], machine: str) -> str:
    """The CMAKE_ARGS for llama-cpp-python on a CPU with `features` (AMX always off)."""
    if machine not in ("x86_64", "AMD64", "i686", "i386"):
        return "-DGGML_NATIVE=ON"
    flags = ["-DGGML_NATIVE=OFF"]
    flags += [f"-D{option}={'ON' if feature in features else 'OFF'}" for feature, option in NAMED]
    flags += [f"-D{option}=OFF" for feature, option in DEFAULT_ON if feature not in features]
    return " ".join(flags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpuinfo", default="/proc/cpuinfo")
    parser.add_argument("--machine", default=platform.machine())
    args = parser.parse_args()
    path = Path(args.cpuinfo)
    print(cmake_args(cpu_features(path.read_text() if path.exists() else ""), args.machine))


if __name__ == "__main__":
    main()
