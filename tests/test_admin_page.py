"""The admin page in headless Chromium on a live gateway: with the admin key it lists tenants,
their keys (names, never secrets), budgets and usage, and issues and revokes a key that the
gateway then accepts and refuses. The browser and its DevTools session are tests/test_playground.py's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ADMIN_KEY, DEMO_KEY, gateway_config, live_gateway
from tests.test_playground import ARTIFACTS, Browser, chromium_binary

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    config = gateway_config(None)
    config["tenants"][0]["daily"] = {"upstream_tokens": 1234}
    with live_gateway(config, tmp_path_factory.mktemp("admin-page")) as running:
        yield running


@pytest.fixture(scope="module")
def page(gateway) -> Iterator[Browser]:
    browser = Browser(chromium_binary())
    try:
        browser.call("Page.enable")
        browser.call("Page.navigate", url=f"{gateway.base_url}/admin")
        browser.wait_for("document.readyState === 'complete' && !!document.getElementById('connect')")
        browser.js(f"$('admin-key').value = {json.dumps(ADMIN_KEY)}; $('connect').click();")
        browser.wait_for("window.admin.connected === true")
        yield browser
    finally:
        browser.close()


def models_status(gateway, key: str) -> int:
    return httpx.get(f"{gateway.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code


def test_the_page_lists_tenants_keys_budgets_and_usage_without_secrets(page):
    text = page.js("document.getElementById('tenants').innerText")
    assert "demo" in text and "config.yaml" in text and "1234" in text
    assert "requests today" in text
    html = page.js("document.documentElement.outerHTML")
    assert DEMO_KEY not in html and ADMIN_KEY not in html


def test_the_page_issues_a_key_that_works_and_revokes_it(page, gateway):
    page.js("$('key-tenant').value = 'demo'; $('key-name').value = 'from-the-browser'; $('issue').click();")
    issued = page.wait_for("window.admin.issued")
    assert page.js("document.getElementById('new-key-secret').textContent") == issued["key"]
    page.wait_for("document.getElementById('tenants').innerText.includes('from-the-browser')")
    assert models_status(gateway, issued["key"]) == 200
    page.screenshot(ARTIFACTS / "admin.png")
    page.js(f"document.querySelector('button[data-key=\"{issued['id']}\"]').click();")
    page.wait_for(f"window.admin.revoked === {json.dumps(issued['id'])}")
    page.wait_for("!document.getElementById('tenants').innerText.includes('from-the-browser')")
    assert models_status(gateway, issued["key"]) == 401


def test_a_wrong_key_is_told_so_on_the_page(gateway):
    browser = Browser(chromium_binary())
    try:
        browser.call("Page.enable")
        browser.call("Page.navigate", url=f"{gateway.base_url}/admin")
        browser.wait_for("document.readyState === 'complete' && !!document.getElementById('connect')")
        browser.js(f"$('admin-key').value = {json.dumps(DEMO_KEY)}; $('connect').click();")
        message = browser.wait_for("document.getElementById('status').className === 'error' && "
                                   "document.getElementById('status').textContent")
        assert "admin key" in message
    finally:
        browser.close()
