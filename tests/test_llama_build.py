"""The llama.cpp build uses exactly the CPU features this machine has, never AMX (it crashes where
the kernel does not grant it), and decodes real tokens."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.cpu_flags import cmake_args, cpu_features

ROOT = Path(__file__).resolve().parent.parent
LLAMA_VERSION = next(line.split("==")[1].split()[0] for line in (ROOT / "requirements" / "llama.txt").read_text().splitlines()
                     if line.startswith("llama-cpp-python=="))
CPU = cpu_features(Path("/proc/cpuinfo").read_text()) if Path("/proc/cpuinfo").exists() else set()

DECODE = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=256, n_threads=1, verbose=False)
out = llm.create_completion("The capital of France is", max_tokens=8, temperature=0)
print(out["usage"]["completion_tokens"], repr(out["choices"][0]["text"]))
"""


def test_installed_build_was_made_with_the_flags_this_cpu_gets():
    stamp = Path(sys.prefix) / ".llama-build-key"  # written by scripts/setup.sh: version + CMAKE_ARGS + recipe
    if not stamp.exists() or os.environ.get("LLAMA_CMAKE_ARGS"):
        pytest.skip("llama-cpp-python was not built by scripts/setup.sh from detected flags")
    flags = cmake_args(CPU, platform.machine())
    key = subprocess.run(["bash", str(ROOT / "scripts" / "build-llama-tools.sh"), "--key"], capture_output=True,
                         text=True, check=True, env={**os.environ, "LLAMA_CMAKE_ARGS": flags}).stdout.strip()
    assert stamp.read_text().strip() == key  # the build of these flags, at the pinned version and recipe
    assert importlib.metadata.version("llama-cpp-python") == LLAMA_VERSION
    assert "AMX" not in flags


def test_installed_build_uses_the_cpu_features_it_was_given():
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    assert "AMX" not in info
    if platform.machine() == "x86_64":
        assert ("AVX2 = 1" in info) == ("avx2" in CPU)
        assert ("AVX512 = 1" in info) == ("avx512f" in CPU)


def test_a_cpu_without_avx512_or_avx2_gets_neither():
    laptop = {"sse4_2", "avx", "fma", "f16c"}  # an older laptop: no AVX2, BMI2 or AVX-512
    args = cmake_args(laptop, "x86_64").split()
    assert {"-DGGML_AVX=ON", "-DGGML_AVX2=OFF", "-DGGML_AVX512=OFF", "-DGGML_BMI2=OFF"} <= set(args)
    assert "-DGGML_SSE42=OFF" not in args
    assert cmake_args(cpu_features("processor : 0\nFeatures : fp asimd\n"), "aarch64") == "-DGGML_NATIVE=ON"


@pytest.mark.integration
def test_real_decode_in_a_subprocess(smol_path):
    # In a subprocess: a SIGSEGV in the build fails this test instead of killing pytest.
    result = subprocess.run([sys.executable, "-c", DECODE, str(smol_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"decode crashed (exit {result.returncode}): {result.stderr[-500:]}"
    count, _ = result.stdout.split(" ", 1)
    assert int(count) > 0
