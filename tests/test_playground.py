"""The playground page in headless Chromium, driven over the Chrome DevTools Protocol, and the front
door that leads a browser to it.

Chromium comes from Debian (scripts/install-chromium.sh); the protocol is spoken over a plain
websocket (websocket-client), so no browser or driver is downloaded at test time. Screenshots
land in artifacts/ (git-ignored).
"""

from __future__ import annotations

import base64
import json
import logging
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import websocket
from fastapi.testclient import TestClient

from gateway.api.app import create_app
from gateway.settings import Settings
from tests.conftest import DEMO_KEY, ROOT, gateway_config, live_gateway, stop

ARTIFACTS = ROOT / "artifacts"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars", "--remote-debugging-port=0", "--window-size=1280,960"]
PROMPT = "What is the capital of France? Answer in one sentence."
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"  # Chromium's
STARTUP_URL = re.compile(r"open (\S+) in a browser for the playground")


# -- the front door, without a model --

def app_without_models(**server):
    async def start(_settings):
        async def close():
            pass
        return SimpleNamespace(aliases={}, local_models={}, shadow=None, close=close)

    config = gateway_config(None)
    config["server"].update(server)
    return create_app(Settings.model_validate(config), start_runtime=start)


def test_the_root_sends_a_browser_to_the_playground():
    with TestClient(app_without_models(), follow_redirects=False) as client:
        door = client.get("/", headers={"accept": BROWSER_ACCEPT})
        assert door.status_code == 307 and door.headers["location"] == "/playground"
        assert "accept" in door.headers["vary"].lower()
        landed = client.get("/", headers={"accept": BROWSER_ACCEPT}, follow_redirects=True)
    assert landed.url.path == "/playground" and landed.headers["content-type"].startswith("text/html")


def test_the_root_answers_an_api_client_in_json_without_a_redirect():
    with TestClient(app_without_models(), follow_redirects=False) as client:
        for accept in ("application/json", "*/*"):  # the openai SDK's, curl's and httpx's
            answer = client.get("/", headers={"accept": accept})
            assert answer.status_code == 200 and "location" not in answer.headers, accept
            assert answer.headers["content-type"] == "application/json"
            assert answer.json()["playground"] == "/playground" and answer.json()["api"] == "/v1"


def test_the_start_up_line_says_where_a_browser_finds_the_playground(caplog):
    caplog.set_level(logging.INFO, logger="gateway")
    with TestClient(app_without_models(host="0.0.0.0", port=8123)):
        pass
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gateway ready")]
    assert STARTUP_URL.search(line).group(1) == "http://127.0.0.1:8123/"  # a wildcard bind is opened on loopback


# -- the page in headless Chromium, on a live gateway --

def chromium_binary() -> str:
    """/usr/bin/chromium, installing it if it is missing; skip only if that cannot be done."""
    found = shutil.which("chromium")
    if found:
        return found
    installer = subprocess.run(["bash", str(ROOT / "scripts/install-chromium.sh")], capture_output=True, text=True)
    found = shutil.which("chromium")
    if installer.returncode != 0 or not found:
        pytest.skip(f"chromium is missing and scripts/install-chromium.sh could not install it: "
                    f"{(installer.stderr or installer.stdout).strip()[-300:]}")
    return found


class Browser:
    """A headless Chromium process and a CDP session on its first page."""

    def __init__(self, binary: str) -> None:
        self.profile = Path(tempfile.mkdtemp(prefix="chromium-profile-"))
        self.process = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port = self._devtools_port()
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"]
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        self._id = 0

    def _devtools_port(self, timeout_s: float = 30.0) -> int:
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.process.returncode}")
            if marker.exists() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            time.sleep(0.1)
        raise RuntimeError("chromium did not open its DevTools port")

    def call(self, method: str, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def js(self, expression: str, await_promise: bool = False):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=await_promise)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page error in {expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 40.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.1)
        status = self.js("document.getElementById('status').textContent")
        raise AssertionError(f"timed out waiting for {expression}; page status: {status}")

    def open(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=1280, height=960, deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && !!document.getElementById('send')")

    def hover(self, selector: str) -> None:
        box = self.js(f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                      f" return [r.left + r.width / 2, r.top + r.height / 2]; }})()")
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=box[0], y=box[1])

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.ws.close()
        stop(self.process)
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def gateway(smol_llama_server, tmp_path_factory):
    config = gateway_config(smol_llama_server, mode="tokens")
    with live_gateway(config, tmp_path_factory.mktemp("playground")) as running:
        yield running


@pytest.fixture(scope="module")
def page(gateway) -> Iterator[Browser]:
    browser = Browser(chromium_binary())
    try:
        browser.open(f"{gateway.base_url}/playground")
        browser.js(f"$('api-key').value = {json.dumps(DEMO_KEY)}; $('connect').click();")
        browser.wait_for("[...$('alias').options].some(o => o.value === 'routed') && !!window.playground.account")
        yield browser
    finally:
        browser.close()


def run_prompt(page: Browser, policy: str, threshold: str = "", prompt: str = PROMPT, max_tokens: int = 10) -> dict:
    """Send a prompt through the page's own form; return what the page received and rendered."""
    page.js(f"""$('alias').value = 'routed'; $('policy').value = {json.dumps(policy)};
               $('threshold').value = {json.dumps(threshold)}; $('max-tokens').value = '{max_tokens}';
               $('temperature').value = '0'; $('seed').value = '7'; $('prompt').value = {json.dumps(prompt)};
               $('send').click();""")
    page.wait_for("window.playground.done && !$('send').disabled")
    return page.js("""({
        events: window.playground.events,
        error: window.playground.error,
        spans: [...document.querySelectorAll('#answer .tok')].map(s => ({
            text: s.textContent, className: s.className, source: s.dataset.source, entropy: s.dataset.entropy,
            top1: s.dataset.top1, title: s.title, background: getComputedStyle(s).backgroundColor})),
        stats: Object.fromEntries([...document.querySelectorAll('.stat dd')].map(d => [d.id, d.textContent])),
        usageRows: [...document.querySelectorAll('#usage-rows tr')].map(r => r.dataset.period),
    })""")


def sse_pieces(events: list[str]) -> tuple[list[tuple[str, dict]], dict]:
    """(content, routing) per content chunk, and the usage, from the raw `data:` payloads."""
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    pieces = [(c["choices"][0]["delta"]["content"], c["routing"]) for c in chunks
              if c["choices"] and c["choices"][0]["delta"].get("content")]
    return pieces, chunks[-1]["usage"]


def legend_colour(page: Browser, source: str) -> str:
    return page.js(f"getComputedStyle(document.querySelector('.legend .src-{source}')).backgroundColor")


def check_rendering(page: Browser, seen: dict, source: str | None = None) -> dict:
    """Each token's text, colour, class and hover values are those of its SSE chunk."""
    assert seen["error"] is None, seen["error"]
    pieces, usage = sse_pieces(seen["events"])
    spans = seen["spans"]
    assert len(spans) == len(pieces) > 0
    for span, (text, routing) in zip(spans, pieces):
        assert span["text"] == text
        assert span["source"] == routing["source"] == (source or routing["source"])
        assert f"src-{span['source']}" in span["className"].split()
        assert span["background"] == legend_colour(page, span["source"])
        if routing["entropy"] is None:
            assert span["entropy"] is None
        else:  # the hover value is the number the SSE chunk carried
            assert float(span["entropy"]) == routing["entropy"]
            assert float(span["top1"]) == routing["top1"]
            assert f"entropy {span['entropy']}" in span["title"] and f"top1 {span['top1']}" in span["title"]
    routing = usage["routing"]
    stats = seen["stats"]
    assert stats["stat-tokens"] == str(usage["completion_tokens"])
    assert stats["stat-calls"] == str(routing["upstream_calls"])
    assert stats["stat-billed"] == f"{routing['upstream_prompt_tokens'] + routing['upstream_completion_tokens']:,}"
    assert stats["stat-cached"] == f"{routing['upstream_cached_tokens']:,}"
    assert "day" in seen["usageRows"] and "month" in seen["usageRows"]
    return usage


def check_hover(page: Browser, seen: dict, index: int) -> None:
    page.hover(f"#answer .tok:nth-child({index + 1})")
    tip = page.wait_for("$('tip').style.display === 'block' && $('tip').textContent")
    span = seen["spans"][index]
    assert tip == span["title"] and tip.startswith(span["source"]) and f"entropy {span['entropy']}" in tip


@pytest.mark.integration
def test_always_renders_every_token_as_upstream_with_its_signal(page):
    seen = run_prompt(page, "always")
    usage = check_rendering(page, seen, "upstream")
    assert usage["routing"]["upstream_calls"] > 0
    check_hover(page, seen, 1)
    page.screenshot(ARTIFACTS / "playground-always.png")


@pytest.mark.integration
def test_never_renders_every_token_as_local(page):
    seen = run_prompt(page, "never")
    usage = check_rendering(page, seen, "local")
    assert usage["routing"]["upstream_calls"] == 0 and seen["stats"]["stat-share"] == "0%"
    check_hover(page, seen, 2)
    page.screenshot(ARTIFACTS / "playground-never.png")


@pytest.mark.integration
def test_entropy_threshold_colours_each_token_by_its_own_source(page):
    seen = run_prompt(page, "entropy", threshold="2.5", prompt="Name three colours of the rainbow.", max_tokens=24)
    usage = check_rendering(page, seen)
    assert usage["routing"]["local_tokens"] > 0 and usage["routing"]["upstream_tokens"] > 0
    for span in seen["spans"]:  # the colour a user sees agrees with the rule "route when entropy > 2.5"
        assert (span["source"] == "upstream") == (float(span["entropy"]) > 2.5), span
    uncertain = [i for i, span in enumerate(seen["spans"]) if span["source"] != "local"]
    check_hover(page, seen, uncertain[0] if uncertain else 0)
    page.screenshot(ARTIFACTS / "playground-entropy.png")


@pytest.mark.integration
def test_page_is_self_contained(gateway):
    response = httpx.get(f"{gateway.base_url}/playground")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in response.headers["content-security-policy"]
    assert "http://" not in response.text and "https://" not in response.text  # no CDN, no external fetch


@pytest.mark.integration
def test_the_serve_command_leads_a_newcomer_from_its_start_up_line_to_the_playground(gateway):
    """What a newcomer does: read the line the serve command printed, open its address in a browser."""
    [address] = STARTUP_URL.findall(gateway.logs())
    assert address == f"{gateway.base_url}/"
    landed = httpx.get(address, headers={"accept": BROWSER_ACCEPT}, follow_redirects=True)
    assert landed.status_code == 200 and landed.url.path == "/playground"
    assert landed.headers["content-type"].startswith("text/html") and "id=\"send\"" in landed.text
