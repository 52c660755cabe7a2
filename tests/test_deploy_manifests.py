"""The deployment recipes under deploy/ are valid before anyone applies them, checked offline:
every Kubernetes manifest against the Kubernetes API's own schemas (kubernetes-validate, strict:
an unknown or misspelt field fails), deploy/compose.yaml against the Compose Specification's
schema (the copy check-jsonschema ships), the gateway configs they carry against the gateway's own
settings, and the probes, ports and host names against what the gateway and the other pieces
really serve. A broken manifest or compose file must fail, which the last tests of each kind show.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema

from adapters.model_files import CATALOG
from gateway.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
# The oldest Kubernetes minor these manifests are meant for, and the newest the validator knows.
K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s(kind: str, name: str) -> dict:
    found = [doc for path in KUBERNETES for doc in documents(path)
             if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def validate_k8s(doc: dict) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def gateway_settings(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in [name for name in os.environ if name.startswith("GATEWAY_")]:
        monkeypatch.delenv(name)  # the file alone, not this machine's overrides
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return load_settings(path)


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def quantity_bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", quantity).groups()
    return int(number) * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}[unit]


# Kubernetes


def test_the_kubernetes_recipe_has_every_piece():
    kinds = sorted(f"{doc['kind']}/{doc['metadata']['name']}" for path in KUBERNETES for doc in documents(path))
    assert kinds == ["ConfigMap/routing-gateway-config", "Deployment/redis", "Deployment/routing-gateway",
                     "NetworkPolicy/redis-from-gateway", "PodDisruptionBudget/routing-gateway", "Service/redis",
                     "Service/routing-gateway"]


@pytest.mark.parametrize("path", KUBERNETES, ids=lambda path: path.name)
def test_every_kubernetes_manifest_validates_against_the_api_schema(path):
    docs = documents(path)
    assert docs, f"{path} holds no manifest"
    for doc in docs:
        validate_k8s(doc)


def test_the_probes_ask_the_gateways_own_health_routes():
    from gateway.api.routes import router

    routes = {route.path for route in router.routes}
    gateway = container(k8s("Deployment", "routing-gateway"))
    port_names = {port["name"]: port["containerPort"] for port in gateway["ports"]}
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health/live"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert gateway[probe]["httpGet"]["path"] in routes
        assert gateway[probe]["httpGet"]["port"] in port_names
    service = k8s("Service", "routing-gateway")
    assert service["spec"]["ports"][0]["targetPort"] in port_names
    assert service["spec"]["selector"].items() <= \
        k8s("Deployment", "routing-gateway")["spec"]["template"]["metadata"]["labels"].items()


def test_the_configmap_is_a_gateway_config_that_reaches_the_redis_service(tmp_path, monkeypatch):
    settings = gateway_settings(k8s("ConfigMap", "routing-gateway-config")["data"]["config.yaml"], tmp_path,
                                monkeypatch)
    deployment = k8s("Deployment", "routing-gateway")
    gateway = container(deployment)
    assert settings.server.host == "0.0.0.0"
    assert settings.server.port == gateway["ports"][0]["containerPort"]
    assert settings.store.backend == "redis"
    env = {item["name"]: item.get("value") for item in gateway["env"]}
    redis_service = k8s("Service", "redis")
    for url in (settings.store.url, env["GATEWAY_STORE__URL"]):
        parsed = urlparse(url)
        assert (parsed.hostname, parsed.port) == ("redis", redis_service["spec"]["ports"][0]["port"])
    mounts = {mount["name"]: mount["mountPath"] for mount in gateway["volumeMounts"]}
    assert gateway["args"] == ["serve", "--config", f"{mounts['config']}/config.yaml"]
    assert gateway["securityContext"]["readOnlyRootFilesystem"] and mounts["tmp"] == "/tmp"
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001  # the image's user


def test_the_gateway_asks_for_the_memory_it_was_measured_to_use():
    resources = container(k8s("Deployment", "routing-gateway"))["resources"]
    request, limit = (quantity_bytes(resources[kind]["memory"]) for kind in ("requests", "limits"))
    # docs/deployment.md: 1426 MiB RSS idle, 1462 MiB at peak, for the gateway and its llama-server child
    assert 1460 << 20 <= request <= limit


@pytest.mark.parametrize("break_it", [
    pytest.param(lambda c: c.update(readinessprobe=c.pop("readinessProbe")), id="misspelt-field"),
    pytest.param(lambda c: c["ports"][0].update(containerPort="http"), id="wrong-type"),
    pytest.param(lambda c: c.pop("name"), id="missing-required"),
])
def test_a_broken_manifest_fails_validation(break_it):
    deployment = copy.deepcopy(k8s("Deployment", "routing-gateway"))
    validate_k8s(deployment)
    break_it(container(deployment))
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(deployment)


# Compose


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def validate_compose(document: dict) -> None:
    schema = get_builtin_schema("vendor.compose-spec")
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.FormatChecker())
    errors = sorted(validator.iter_errors(document), key=lambda error: list(error.absolute_path))
    if errors:
        raise jsonschema.ValidationError(
            "; ".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors))


def test_the_compose_file_validates_against_the_compose_spec():
    validate_compose(compose())
    services = compose()["services"]
    assert {"redis", "upstream", "gateway", "lb", "models"} <= services.keys()
    assert services["gateway"]["deploy"]["replicas"] >= 2


def test_the_compose_gateway_config_reaches_the_upstream_and_redis_services(tmp_path, monkeypatch):
    services = compose()["services"]
    settings = gateway_settings((DEPLOY / "compose" / "gateway.yaml").read_text(), tmp_path, monkeypatch)
    assert settings.store.backend == "redis"
    for url in (settings.store.url, services["gateway"]["environment"]["GATEWAY_STORE__URL"]):
        assert urlparse(url).hostname == "redis"
    command = services["upstream"]["command"]
    arg = dict(zip(command[::2], command[1::2]))
    (upstream,) = {upstream for alias in settings.aliases.values() if (upstream := alias.upstream)}
    upstream = settings.upstreams[upstream]
    parsed = urlparse(upstream.api_base)
    assert (parsed.hostname, str(parsed.port)) == ("upstream", arg["--port"])
    assert upstream.model.split("/", 1)[1] == arg["--alias"]
    # the gateway renders token ids with the very GGUF the upstream serves
    assert Path(arg["--model"]).name == CATALOG[upstream.template_gguf].filename
    assert services["models"]["command"] == [upstream.template_gguf]
    mounts = [volume.split(":") for volume in services["gateway"]["volumes"]]
    assert ["./compose/gateway.yaml", "/etc/routing-gateway/config.yaml", "ro"] in mounts
    assert (DEPLOY / "compose" / "gateway.yaml").is_file() and (DEPLOY / "compose" / "nginx.conf").is_file()


def test_nginx_balances_over_the_gateway_service_on_its_port():
    conf = (DEPLOY / "compose" / "nginx.conf").read_text()
    servers = re.findall(r"^\s*server\s+([\w.-]+):(\d+)", conf, flags=re.MULTILINE)
    assert servers == [("gateway", "8000")]
    assert "proxy_buffering off" in conf  # streamed answers are not held back


@pytest.mark.parametrize("break_it", [
    pytest.param(lambda s: s["gateway"].update(imagee=s["gateway"].pop("image")), id="misspelt-key"),
    pytest.param(lambda s: s["gateway"].update(volumes=" ".join(s["gateway"]["volumes"])), id="wrong-type"),
    pytest.param(lambda s: s["gateway"]["depends_on"]["redis"].update(condition="service_up"), id="bad-enum"),
])
def test_a_broken_compose_file_fails_validation(break_it):
    document = compose()
    break_it(document["services"])
    with pytest.raises(jsonschema.ValidationError):
        validate_compose(document)
