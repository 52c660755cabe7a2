"""A longer schemathesis run against a live gateway: OpenAI's chat completions spec and the gateway's own.

Run: .venv/bin/python -m bench.openapi_fuzz [--examples 500] [--gateway-examples N] [--seed S]

Starts a llama-server upstream (SmolLM2) and a gateway process (SmolLM2 local, the OpenAI spec's
model names as aliases that pass through to that upstream what the local model cannot serve; the
the fuzzing below, which tests/test_openapi_fuzz.py runs too), sends positive cases (bodies the schema
accepts) generated from (a) tests/data/openai-chat-completions.openapi.json, POST /chat/completions,
(b) tests/data/openai-responses.openapi.json, the Responses API, and (c) the gateway's own
/openapi.json, every operation. Prints counts by status code, the served
(2xx) share, the number of 5xx and any check failures (a 5xx other than a 502 passing on the
upstream's own failure, or a non-2xx response that is not OpenAI's error envelope). Exits 1 on any
check failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Err
from schemathesis.errors import FailureGroup

from adapters.model_files import resolve_model
from bench.support import DEMO_KEY, ROOT, SMOL, LiveGateway, gateway_config, live_gateway, upstream_server

OPENAI_SPEC = ROOT / "tests" / "data" / "openai-chat-completions.openapi.json"
RESPONSES_SPEC = ROOT / "tests" / "data" / "openai-responses.openapi.json"
# The narrowed OpenAI spec's `model` enum; the fuzz gateway serves both names: local decoding,
# and the llama-server upstream for what only it can serve (tools, images, ...).
ALIASES = ("smollm2-routed", "smollm2-local")
AUTH = {"Authorization": f"Bearer {DEMO_KEY}"}
SEED = 20261130
REQUEST_TIMEOUT_S = 60
ERROR_KEYS = {"message", "type", "param", "code"}
# a 400 that names a capability the gateway or its configured upstream lacks (a tool type, an input
# item type, a medium, an API such as Conversations), as against a body it found invalid
CAPABILITY_WORDS = ("not served here", "does not read", "needs the upstream model")


def fuzz_gateway_config(upstream_base: str) -> dict:
    """The test gateway's config: the OpenAI spec's model names as aliases that decode locally and
    pass through to a llama-server upstream what the local model cannot serve."""
    aliases = {name: {"local": "smol", "upstream": "up", "routing": {"policy": "never"}} for name in ALIASES}
    config = gateway_config(upstream_base, mode="tokens", aliases=aliases)
    config["upstreams"]["up"]["kind"] = "llama-server"  # its parser's needs (adapters/message_shapes.py)
    # short answers: the gateway's own schema allows max_tokens up to the limit, and none means the default
    config["server"].update(default_max_tokens=8, max_tokens_limit=16, docs=True)  # docs: its /openapi.json
    # a body passed through with a huge max_tokens has the upstream write up to its context: on a
    # busy machine longer than the fuzzer waits; the gateway gives up first (a 502 upstream_unavailable),
    # and such time-outs must not open the breaker (every later pass-through would be a 503)
    config["upstreams"]["up"].update(passthrough_timeout_s=REQUEST_TIMEOUT_S / 2, breaker_failures=1000)
    return config


@contextlib.contextmanager
def fuzz_gateway(tmp: Path, upstream_base: str) -> Iterator[LiveGateway]:
    with live_gateway(fuzz_gateway_config(upstream_base), tmp) as gateway:
        yield gateway


def gateway_not_at_fault(ctx, response, case) -> bool | None:
    """schemathesis' `not_a_server_error`, except the 502 that reports the upstream's failure."""
    if response.status_code == 502 and _error_code(response) == "upstream_unavailable":
        return None
    return not_a_server_error(ctx, response, case)


def _error_code(response) -> str | None:
    try:
        return json.loads(response.content)["error"]["code"]
    except (ValueError, TypeError, KeyError):
        return None


def openai_error_shape(ctx, response, case) -> bool | None:
    """A schemathesis check: a non-2xx response is exactly OpenAI's error envelope."""
    if 200 <= response.status_code < 300:
        return None
    try:
        body = json.loads(response.content)
    except ValueError as exc:
        raise AssertionError(f"{response.status_code} with a non-JSON body: {response.content[:300]!r}") from exc
    assert isinstance(body, dict) and set(body) == {"error"}, f"not an error envelope: {body!r}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == ERROR_KEYS, f"error keys are not {sorted(ERROR_KEYS)}: {body!r}"
    assert isinstance(error["message"], str) and error["message"], f"empty error message: {body!r}"
    assert isinstance(error["type"], str) and error["type"], f"error type is not a string: {body!r}"
    assert error["param"] is None or isinstance(error["param"], str), f"param is not a string or null: {body!r}"
    assert error["code"] is None or isinstance(error["code"], str), f"code is not a string or null: {body!r}"
    return None


def names_param_on_400(ctx, response, case) -> bool | None:
    """A schemathesis check for bodies OpenAI accepts: a 400 refusing one names the field in `param`."""
    if response.status_code == 400:
        try:
            error = json.loads(response.content)["error"]
            param = error["param"]
        except (ValueError, TypeError, KeyError):
            return None  # not an error envelope at all: openai_error_shape reports it
        assert param is not None, f"400 without `param`: {error!r}"  # "" is a field name too
    return None


@dataclass
class FuzzReport:
    """What one fuzz run saw: statuses per operation, refused params, and every check failure."""

    name: str
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    refused_params: Counter = field(default_factory=Counter)
    refusal_example: dict[str, str] = field(default_factory=dict)  # first message seen per status and param
    server_errors_seen: list[str] = field(default_factory=list)  # each 5xx: the request body and the answer
    capability_refusals: Counter = field(default_factory=Counter)  # per operation: 400s naming what is not served
    failures: list[str] = field(default_factory=list)

    def record(self, label: str, status: int, content: bytes, body: object = None) -> None:
        self.statuses[label][status] += 1
        if status >= 500:
            self.server_errors_seen.append(f"{label} -> {status}: {content[:300].decode('utf-8', 'replace')}\n"
                                           f"    request body: {_json_or_repr(body)[:600]}")
        if 400 <= status < 500:
            with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
                error = json.loads(content)["error"]
                key = f"{status} {error['param']}"
                if status == 400 and any(words in error["message"] for words in CAPABILITY_WORDS):
                    self.capability_refusals[label] += 1
                self.refused_params[key] += 1
                self.refusal_example.setdefault(key, error["message"][:160])

    def by_status(self, label: str | None = None) -> Counter:
        if label is not None:
            return self.statuses[label]
        return sum(self.statuses.values(), Counter())

    def total(self, label: str | None = None) -> int:
        return sum(self.by_status(label).values())

    def served(self, label: str | None = None) -> int:
        return sum(n for status, n in self.by_status(label).items() if 200 <= status < 300)

    def server_errors(self, label: str | None = None) -> int:
        return sum(n for status, n in self.by_status(label).items() if status >= 500)

    def summary(self) -> str:
        lines = [f"[{self.name}] {self.total()} requests, {self.served()} served (2xx) "
                 f"= {self.served() / max(1, self.total()):.1%}, 5xx: {self.server_errors()}, "
                 f"check failures: {len(self.failures)}"]
        for label in sorted(self.statuses):
            counts = ", ".join(f"{status}: {n}" for status, n in sorted(self.statuses[label].items()))
            answered = self.served(label) + self.capability_refusals[label]
            lines.append(f"  {label}: {self.total(label)} requests ({counts}), "
                         f"2xx share {self.served(label) / max(1, self.total(label)):.1%}, served or refused "
                         f"for a capability not served {answered / max(1, self.total(label)):.1%}")
        if self.server_errors_seen:
            lines.append("  5xx (first three):")
            lines += [f"    {seen}" for seen in self.server_errors_seen[:3]]
        if self.refused_params:
            lines.append("  refusals by status and param (count, first message):")
            lines += [f"    {key!r} x{n}: {self.refusal_example[key]}" for key, n in self.refused_params.most_common(12)]
        return "\n".join(lines)


def load_openai_spec(config: schemathesis.Config | None = None):
    """(a): OpenAI's description, only POST /chat/completions, held to its documented contract
    (`documented_contract`); servers are given per call, not fetched."""
    raw = documented_contract(json.loads(OPENAI_SPEC.read_text()))
    schema = schemathesis.openapi.from_dict(raw, config=config or schemathesis.Config())
    return schema.include(method="POST", path="/chat/completions")


def documented_contract(spec: dict) -> dict:
    """Rules OpenAI's API enforces that its schema leaves out, so that fuzzing sends what the API
    itself accepts: no request arguments beyond the documented ones (the API answers
    "Unrecognized request argument supplied"; the schema's allOf cannot say so, so it is flattened
    into one closed object), `logit_bias` maps token ids to biases in [-100, 100], and
    `top_logprobs` needs `logprobs: true` (both in their descriptions' words). Objects inside the
    request stay open, as the API leaves them."""
    schemas = spec["components"]["schemas"]
    properties, required = _flat(schemas, schemas["CreateChatCompletionRequest"])
    properties["logit_bias"] = {**properties["logit_bias"], "propertyNames": {"pattern": "^[0-9]{1,5}$"},
                                "additionalProperties": {"type": "integer", "minimum": -100, "maximum": 100}}
    schemas["CreateChatCompletionRequest"] = {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False,
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    }
    return spec


def load_responses_spec(config: schemathesis.Config | None = None):
    """(c): OpenAI's description of the Responses API (create, retrieve, delete), its create body
    closed at the top level as the API enforces it, `model` one of the test aliases, and `input`
    and `max_output_tokens` (at OpenAI's minimum of 16) required, so that every body asks for an
    answer and reaches the decoder quickly."""
    spec = json.loads(RESPONSES_SPEC.read_text())
    schemas = spec["components"]["schemas"]
    properties, required = _flat(schemas, schemas["CreateResponse"])
    properties["model"] = {"type": "string", "enum": list(ALIASES)}
    properties["max_output_tokens"] = {"type": "integer", "minimum": 16, "maximum": 16}
    schemas["CreateResponse"] = {"type": "object", "properties": properties, "additionalProperties": False,
                                 "required": sorted({*required, "model", "input", "max_output_tokens"})}
    return schemathesis.openapi.from_dict(spec, config=config or schemathesis.Config())


def _flat(schemas: dict, schema: dict) -> tuple[dict, list]:
    """The properties and required names of an allOf of objects, as one object's."""
    properties, required = {}, []
    for part in schema.get("allOf", [schema]):
        if "$ref" in part:
            part = schemas[part["$ref"].rsplit("/", 1)[1]]
        if "allOf" in part:
            more, more_required = _flat(schemas, part)
            properties.update(more)
            required += more_required
        else:
            properties.update(part.get("properties", {}))
            required += part.get("required", [])
    return properties, required


def load_gateway_spec(base_url: str, config: schemathesis.Config | None = None):
    """(b): the gateway's own /openapi.json, fetched here over loopback and handed over as data."""
    raw = httpx.get(f"{base_url}/openapi.json", timeout=30, trust_env=False).raise_for_status().json()
    return schemathesis.openapi.from_dict(raw, config=config or schemathesis.Config())


def fuzz(schema, base_url: str, *, name: str, examples: int, seed: int = SEED,
         extra_checks: tuple = ()) -> FuzzReport:
    """Send up to `examples` positive cases per operation of `schema` to `base_url`; record, never stop early."""
    report = FuzzReport(name)
    checks = [gateway_not_at_fault, openai_error_shape, *extra_checks]
    operations = []
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise result.err()  # an operation schemathesis cannot use is a failure, not a skip
        operations.append(result.ok())
    assert operations, f"{name}: the spec describes no operations"
    with requests.Session() as session:
        session.trust_env = False  # loopback only: no proxies from the environment
        for operation in operations:
            strategy = operation.as_strategy(generation_mode=GenerationMode.POSITIVE)

            @hypothesis_seed(seed)
            @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
            @given(case=strategy)
            def one(case) -> None:
                response = case.call(base_url=base_url, session=session, headers=dict(AUTH),
                                     timeout=REQUEST_TIMEOUT_S)
                report.record(operation.label, response.status_code, response.content, case.body)
                try:
                    case.validate_response(response, checks=checks, headers=dict(AUTH))
                except FailureGroup as group:
                    reasons = "; ".join(f"{type(exc).__name__}: {exc}" for exc in group.exceptions)
                    report.failures.append(
                        f"{operation.label} -> {response.status_code}\n  reasons: {reasons}\n"
                        f"  request body: {_json_or_repr(case.body)}\n"
                        f"  response: {response.content[:1000].decode('utf-8', 'replace')}")

            one()
    return report


def _json_or_repr(value) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)[:2000]
    except (TypeError, ValueError):
        return repr(value)[:2000]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="cases per operation of OpenAI's spec")
    parser.add_argument("--gateway-examples", type=int, default=None,
                        help="cases per operation of the gateway's own spec (default: --examples)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--show", type=int, default=10, help="failures to print in full")
    args = parser.parse_args()
    gateway_examples = args.gateway_examples if args.gateway_examples is not None else args.examples

    reports = []
    smol = resolve_model(SMOL)
    with tempfile.TemporaryDirectory(prefix="openapi-fuzz-") as tmp, \
            upstream_server(smol, "smol-llama-server", server="llama-server") as upstream, \
            fuzz_gateway(Path(tmp), upstream) as gateway:
        for name, schema, base_url, examples, extra in (
            ("openai spec", load_openai_spec(), f"{gateway.base_url}/v1", args.examples, (names_param_on_400,)),
            ("openai responses spec", load_responses_spec(), f"{gateway.base_url}/v1", args.examples,
             (names_param_on_400,)),
            ("gateway spec", load_gateway_spec(gateway.base_url), gateway.base_url, gateway_examples, ()),
        ):
            started = time.monotonic()
            report = fuzz(schema, base_url, name=name, examples=examples, seed=args.seed, extra_checks=extra)
            print(report.summary())
            print(f"  ({time.monotonic() - started:.0f} s)", flush=True)
            reports.append(report)
        if any(report.server_errors() for report in reports):
            print("\ngateway log (last 4000 characters):\n" + gateway.logs()[-4000:])

    failures = [failure for report in reports for failure in report.failures]
    for failure in failures[: args.show]:
        print("\n" + failure)
    server_errors = sum(report.server_errors() for report in reports)
    print(f"\ntotal: {sum(r.total() for r in reports)} requests, {server_errors} 5xx, {len(failures)} check failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
