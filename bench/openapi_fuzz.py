"""A longer schemathesis run against a live gateway: OpenAI's chat completions spec and the gateway's own.

Run: .venv/bin/python -m bench.openapi_fuzz [--examples 500] [--gateway-examples N] [--seed S]

Starts a llama-server upstream (SmolLM2) and a gateway process (SmolLM2 local, the OpenAI spec's
model names as aliases that pass through to that upstream what the local model cannot serve; the
same helpers as tests/test_openapi_fuzz.py), sends positive cases (bodies the schema
accepts) generated from (a) tests/data/openai-chat-completions.openapi.json, POST /chat/completions,
(b) tests/data/openai-responses.openapi.json, the Responses API, and (c) the gateway's own
/openapi.json, every operation. Prints counts by status code, the served
(2xx) share, the number of 5xx and any check failures (a 5xx other than a 502 passing on the
upstream's own failure, or a non-2xx response that is not OpenAI's error envelope). Exits 1 on any
check failure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from adapters.model_files import resolve_model
from tests.conftest import SMOL, upstream_server
from tests.test_openapi_fuzz import (
    SEED,
    fuzz,
    fuzz_gateway,
    load_gateway_spec,
    load_openai_spec,
    load_responses_spec,
    names_param_on_400,
)


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
