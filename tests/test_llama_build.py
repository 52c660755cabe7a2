"""The llama.cpp build must not use AMX (it crashes here), and must decode real tokens."""

from __future__ import annotations

import subprocess
import sys

import pytest

DECODE = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=256, n_threads=1, verbose=False)
out = llm.create_completion("The capital of France is", max_tokens=8, temperature=0)
print(out["usage"]["completion_tokens"], repr(out["choices"][0]["text"]))
"""


def test_system_info_has_no_amx():
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    assert "AVX2 = 1" in info
    assert "AMX" not in info


@pytest.mark.integration
def test_real_decode_in_a_subprocess(smol_path):
    # In a subprocess: a SIGSEGV in the build fails this test instead of killing pytest.
    result = subprocess.run([sys.executable, "-c", DECODE, str(smol_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"decode crashed (exit {result.returncode}): {result.stderr[-500:]}"
    count, _ = result.stdout.split(" ", 1)
    assert int(count) > 0
