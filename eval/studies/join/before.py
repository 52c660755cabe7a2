"""join_study with adapters/continuation_modes.py as it was before the join fix (commit f4a2a44),
for the before-count in results/join/README.md:

    .venv/bin/python -m eval.studies.join.before run --rows 0:100 --config entropy@2.5 \
        --modes chat_fallback --out results/join/before
"""

import importlib.util
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import adapters

ROOT = Path(__file__).resolve().parents[3]
BEFORE = "f4a2a447128be175e315efdfc390e59d4098c3e3"

source = subprocess.run(["git", "show", f"{BEFORE}:adapters/continuation_modes.py"], cwd=ROOT, check=True,
                        capture_output=True, text=True).stdout
path = Path(tempfile.mkdtemp()) / "continuation_modes.py"
path.write_text(source)
spec = importlib.util.spec_from_file_location("adapters.continuation_modes", path)
module = importlib.util.module_from_spec(spec)
sys.modules["adapters.continuation_modes"] = module
spec.loader.exec_module(module)
adapters.continuation_modes = module
sys.argv = ["join_study", *sys.argv[1:]]
runpy.run_module("eval.studies.join.join_study", run_name="__main__")
