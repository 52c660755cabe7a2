"""The settings tree: config.yaml, environment overrides, one-line errors, and every configuration
the docs show."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from gateway.settings import (
    AliasSettings,
    ModelsSettings,
    RoutingOverride,
    RoutingSettings,
    ServerSettings,
    Settings,
    SettingsError,
    StoreSettings,
    TenantSettings,
    UpstreamSettings,
    draft_problem,
    load_settings,
)
from gateway.settings.shadow import OperatorShadowSettings
from gateway.settings.tracing import TracingSettings
from gateway.tenancy.records import key_digest
from gateway.tenancy.tenants import TenantDirectory
from policies import POLICIES

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_config_loads():
    settings = load_settings(ROOT / "config.yaml")
    assert set(settings.aliases) == {"smollm2-routed", "smollm2-local"}
    assert settings.store.backend == "memory"


def test_alias_without_routing_defaults_to_entropy_2():
    settings = load_settings_text("models: {local: {a: {gguf: x}}}\naliases: {m: {local: a}}\n")
    assert (settings.aliases["m"].routing.policy, settings.aliases["m"].routing.threshold) == ("entropy", 2.0)


def load_settings_text(text: str):
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as handle:
        handle.write(text)
        handle.flush()
        return load_settings(handle.name)


def test_environment_overrides_nested_keys(monkeypatch):
    monkeypatch.setenv("GATEWAY_SERVER__PORT", "9123")
    monkeypatch.setenv("GATEWAY_STORE__BACKEND", "redis")
    settings = load_settings(ROOT / "config.yaml")
    assert settings.server.port == 9123 and settings.store.backend == "redis"
    assert settings.aliases["smollm2-routed"].routing.policy == "entropy"  # the rest of the file stays


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("models: {local: {a: {gguf: x}}}\naliases: {m: {local: b}}\n", "aliases.m.local: no local model 'b'"),
        ("models: {local: {a: {gguf: x}}}\naliases: {m: {local: a, routing: {policy: top1}}}\n", "needs a threshold"),
        ("models: {local: {a: {gguf: x}}}\naliases: {m: {local: a, routing: {escalation: draft}}}\n",
         "escalation 'draft' needs answer_value"),
        ("models: {local: {a: {gguf: x}}}\naliases: {}\nstore: {url: 'redis://h:99999'}\n", "store.url"),
        ("- just\n- a list\n", "mapping at the top level"),
    ],
)
def test_errors_are_one_line_naming_the_key(tmp_path, text, needle):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(SettingsError) as caught:
        load_settings(path)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_registered_policy_is_a_policy_the_settings_accept(name):
    fields = {"threshold": 1.0, "target_fraction": 0.1, "router": "router.json"}  # whatever a policy needs
    assert RoutingSettings(policy=name, **fields).policy == name
    assert RoutingOverride(policy=name).policy == name
    assert name in RoutingSettings.model_json_schema()["properties"]["policy"]["enum"]


def test_a_policy_nobody_registered_is_refused_naming_the_field():
    with pytest.raises(SettingsError, match=r"aliases\.m\.routing\.policy: Input should be 'never', 'always'"):
        load_settings_text("models: {local: {a: {gguf: x}}}\naliases: {m: {local: a, routing: {policy: bogus}}}\n")
    with pytest.raises(ValidationError) as refused:
        RoutingOverride(policy="bogus")
    assert refused.value.errors()[0]["loc"] == ("policy",) and refused.value.errors()[0]["type"] == "literal_error"
    assert RoutingSettings.model_json_schema()["properties"]["policy"]["enum"] == list(POLICIES)


def test_tenant_keys_are_held_as_digests(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(f"""
models: {{local: {{a: {{gguf: x}}}}}}
aliases: {{m: {{local: a}}}}
tenants:
  - {{id: hashed, api_key_sha256: {key_digest("sk-one")}}}
  - {{id: from-env, api_key_env: MY_KEY}}
""")
    settings = load_settings(path)
    directory = TenantDirectory(settings.tenants, {"MY_KEY": "sk-two", "ADMIN": "sk-admin"}, "ADMIN")
    assert directory.authenticate("sk-one").id == "hashed"
    assert directory.authenticate("sk-two").id == "from-env"
    assert directory.authenticate("sk-three") is None
    assert directory.is_admin("sk-admin") and not directory.is_admin("sk-one")
    with pytest.raises(SettingsError, match="MY_KEY is not set"):
        TenantDirectory(settings.tenants, {}, "ADMIN")


@pytest.mark.parametrize(("fields", "priced", "problem"), [
    ({"answer_value": 1.0}, True, None),
    ({}, True, "needs answer_value"),  # nothing else escalates a draft
    ({"answer_value": 1.0, "early_escalation": False}, True, "needs answer_value with early_escalation"),
    ({"answer_value": 1.0, "max_upstream_tokens": 50}, True, "max_upstream_tokens"),
    ({"answer_value": 1.0, "max_upstream_share": 0.5}, True, "max_upstream_share"),
    ({"answer_value": 1.0}, False, "needs an upstream with prices"),
])
def test_a_draft_needs_what_can_end_it(fields, priced, problem):
    routing = {**RoutingSettings(policy="never").model_dump(), "escalation": "draft", **fields}
    found = draft_problem(routing, priced)
    assert found is None if problem is None else problem in found
    assert draft_problem({**routing, "escalation": "afresh"}, priced) is None


# -- every configuration the docs show still loads --

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SECTIONS = {"server": ServerSettings, "store": StoreSettings, "shadow": OperatorShadowSettings,
            "tracing": TracingSettings}


def yaml_blocks(path: Path) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", path.read_text(), flags=re.S)


def settings_fragments() -> list[tuple[str, str, dict]]:
    """(doc, where, value) for each part of the settings tree a doc's YAML block shows."""
    fragments = []
    for path in DOCS:
        for number, block in enumerate(yaml_blocks(path)):
            data = yaml.safe_load(textwrap.dedent(block))
            doc = f"{path.relative_to(ROOT)}#{number}"
            if not isinstance(data, dict) or not set(data) & (set(Settings.model_fields) | {"routing"}):
                continue  # another tool's configuration (Prometheus, say)
            fragments += [(doc, key, value) for key, value in data.items()]
    return fragments


@pytest.mark.parametrize(("doc", "key", "value"), settings_fragments(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_settings_fragment_in_the_docs_validates(doc, key, value):
    if key in SECTIONS:
        SECTIONS[key].model_validate(value)
    elif key == "aliases":
        for entry in value.values():  # an alias shown only for its routing (tune's alias.yaml) has no `local`
            AliasSettings.model_validate(entry) if "local" in entry else RoutingSettings.model_validate(entry["routing"])
    elif key == "upstreams":
        for entry in value.values():
            UpstreamSettings.model_validate(entry)
    elif key == "models":
        ModelsSettings.model_validate(value)
    elif key == "tenants":
        for tenant in value:
            TenantSettings.model_validate(tenant)
    elif key == "routing":
        RoutingSettings.model_validate(value)
    else:
        assert key == "admin_key_env", f"{doc}: unknown settings section {key!r}"


def test_the_docs_show_settings_fragments_of_every_kind():
    keys = {key for _, key, _ in settings_fragments()}
    assert {"models", "upstreams", "aliases", "tenants", "shadow", "routing"} <= keys
