"""Opt-in: the container image builds without a Docker daemon and answers.

scripts/build-image.sh builds the Dockerfile with buildah over a Debian bookworm base it makes with
mmdebstrap, then runs the image as its own user and checks its HEALTHCHECK command
(/health/ready) and one chat completion on the embedded defaults (demo key, smollm2-routed, every
step routed to the llama-server inside the image). It needs root, a Debian mirror and PyPI, and
minutes (10+ more when no setup cache of this machine can seed the build), so it runs only with
GATEWAY_TEST_IMAGE=1. Then, in the image as its user, the fitting commands (fitting/, packaged with
the gateway) start (`python -m gateway tune --help`, `steer --help`) and run: `steer fit` and
`steer report` on the image's SmolLM2 (the report asks for --no-heatmap in one line: the image
carries no matplotlib), and `tune` on six prompts with the embedded defaults' routed alias.
About 6 minutes with a seeded build, 3 more for the fitting checks (buildah's vfs storage copies
the image for each container).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.environ.get("GATEWAY_TEST_IMAGE") != "1",
                       reason="builds and runs the container image with buildah (root, minutes): "
                              "set GATEWAY_TEST_IMAGE=1 to run it"),
]


IMAGE = os.environ.get("IMAGE", "localhost/routing-gateway:latest")  # as scripts/build-image.sh names it
BUILDAH = ["buildah", "--storage-driver", os.environ.get("STORAGE_DRIVER", "vfs")]


@pytest.fixture(scope="module")
def built() -> subprocess.CompletedProcess:
    """scripts/build-image.sh, run once: the image built, run and checked."""
    return subprocess.run(["bash", "scripts/build-image.sh"], cwd=ROOT, capture_output=True, text=True, timeout=3500)


class Container:
    """A fresh container of the image, removed on exit: `run` runs `python -m gateway ARGS` in it as
    the image's user (its entrypoint, environment and working directory), `put` and `read` move
    files in and out."""

    def __enter__(self) -> Container:
        self.name = subprocess.run([*BUILDAH, "from", "--quiet", IMAGE], capture_output=True, text=True, check=True,
                                   timeout=600).stdout.strip()
        self.config = json.loads(subprocess.run([*BUILDAH, "inspect", "--type", "image", IMAGE], capture_output=True,
                                                text=True, check=True, timeout=120).stdout)["Docker"]["config"]
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run([*BUILDAH, "rm", self.name], capture_output=True, timeout=120)

    def put(self, path: str, text: str) -> None:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as source:
            source.write(text)
            source.flush()
            subprocess.run([*BUILDAH, "copy", "--chown", self.config["User"], self.name, source.name, path],
                           capture_output=True, check=True, timeout=120)

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*BUILDAH, "run", "--isolation", "chroot", "--user", self.config["User"], self.name,
                               "--", *self.config["Entrypoint"], *args], capture_output=True, text=True, timeout=900)

    def read(self, *paths: str) -> dict[str, bytes]:
        """The files of `paths` that exist, by path."""
        root = Path(subprocess.run([*BUILDAH, "mount", self.name], capture_output=True, text=True, check=True,
                                   timeout=120).stdout.strip())
        try:
            return {path: (root / path.lstrip("/")).read_bytes() for path in paths
                    if (root / path.lstrip("/")).is_file()}
        finally:
            subprocess.run([*BUILDAH, "umount", self.name], capture_output=True, timeout=120)


def errors(result: subprocess.CompletedProcess) -> list[str]:
    """The command's own error lines (buildah adds lines of its own when a command exits non-zero)."""
    return [line for line in result.stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.timeout(3600)
def test_the_image_builds_runs_as_its_user_and_answers(built):
    results = dict(re.findall(r"^RESULT (\w+)=(\S+)$", built.stdout, flags=re.MULTILINE))
    tail = built.stdout[-6000:] + built.stderr[-3000:]
    assert results.get("health") == "ok", tail  # the image's own HEALTHCHECK command passed
    assert results.get("chat") == "ok", tail  # a chat completion came back, its upstream steps from llama-server
    assert int(results["size_bytes"]) > 0
    assert built.returncode == 0, tail


@pytest.mark.timeout(3600)
def test_the_fitting_commands_start_in_the_image(built):
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    with Container() as container:
        for command in (["tune", "--help"], ["steer", "--help"], ["steer", "fit", "--help"],
                        ["steer", "report", "--help"]):
            result = container.run(*command)
            assert result.returncode == 0, (command, result.stdout[-3000:] + result.stderr[-3000:])
            assert "usage: python -m gateway" in result.stdout


PAIRS = "".join(json.dumps({"positive": f"Answer in French. {q}", "negative": f"Answer in English. {q}"}) + "\n"
                for q in ["What is the capital of France?", "Name a yellow fruit.", "How many days are in a week?",
                          "What colour is the sky?"])


@pytest.mark.timeout(3600)
def test_steer_fits_and_reports_in_the_image(built):
    """On the image's SmolLM2: the hidden states come through adapters.hidden_states from the
    image's own llama.cpp libraries; the report asks for --no-heatmap in one line (no matplotlib)."""
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    with Container() as container:
        container.put("/tmp/french.jsonl", PAIRS)
        fit = container.run("steer", "fit", "--model", "smollm2-135m-instruct", "--pairs", "/tmp/french.jsonl",
                            "--out", "/tmp/french.npz")
        assert fit.returncode == 0, fit.stdout[-3000:] + fit.stderr[-3000:]
        assert "/tmp/french.npz: 30 layers x 576 from 4 pairs (mean)" in fit.stdout
        assert container.read("/tmp/french.npz")["/tmp/french.npz"][:2] == b"PK"  # numpy's .npz
        report = ["steer", "report", "--model", "smollm2-135m-instruct", "--pairs", "/tmp/french.jsonl",
                  "--folds", "2", "--out", "/tmp/report"]
        refused = container.run(*report)
        assert refused.returncode == 2 and errors(refused) == [
            "error: steer report's heatmap.png needs matplotlib, which is not installed: "
            "pip install 'routing-gateway[fitting]' (or pass --no-heatmap)"], refused.stderr[-3000:]
        written = container.run(*report, "--no-heatmap")
        assert written.returncode == 0, written.stdout[-3000:] + written.stderr[-3000:]
        left = container.read("/tmp/report/report.json", "/tmp/report/heatmap.png")
    assert list(left) == ["/tmp/report/report.json"]
    assert len(json.loads(left["/tmp/report/report.json"])["probe_accuracy"]["french"]) == 30


QUESTIONS = [("Which is a colour?\nA. red\nB. seven\nAnswer with the letter.", "A"),
             ("Which is a number?\nA. blue\nB. seven\nAnswer with the letter.", "B"),
             ("Which is an animal?\nA. dog\nB. rock\nAnswer with the letter.", "A"),
             ("Which is a fruit?\nA. stone\nB. apple\nAnswer with the letter.", "B"),
             ("Which can fly?\nA. bird\nB. brick\nAnswer with the letter.", "A"),
             ("Which is cold?\nA. fire\nB. ice\nAnswer with the letter.", "B")]


@pytest.mark.timeout(3600)
def test_tune_runs_in_the_image(built):
    """The embedded defaults' routed alias (SmolLM2, Qwen2.5-Coder-0.5B on llama-server, both in the
    image) tuned on six prompts: decoded, fitted, chosen and written as the image's user."""
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    rows = [{"prompt": q, "reference": ref, "format": "letter"} for q, ref in QUESTIONS]
    rows[0]["reference"], rows[1]["reference"] = "A", "Z"  # one right, one wrong: a check can be fitted
    files = ("/tmp/tuned/alias.yaml", "/tmp/tuned/tune.json", "/tmp/tuned/answer-check.json")
    with Container() as container:
        container.put("/tmp/prompts.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
        result = container.run("--log-level", "warning", "tune", "--config", "/etc/routing-gateway/config.yaml",
                               "--alias", "smollm2-routed", "--prompts", "/tmp/prompts.jsonl", "--out", "/tmp/tuned",
                               "--fit-rows", "0:2", "--choose-rows", "2:4", "--report-rows", "4:6", "--agree", "0",
                               "--max-tokens", "4")
        left = container.read(*files)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "6 prompts x 2 configs, 12 answers to decode" in result.stdout
    assert set(left) == set(files)
    assert json.loads(left["/tmp/tuned/tune.json"])["splits"]["report"] == "4:6"
