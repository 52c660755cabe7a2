"""Issue #63: `combine: contrastive` and `fuse` served through the OpenAI API on the reference pair
(Qwen2.5-Coder-0.5B local in a gateway process, 1.5B upstream on a llama-server child, tokens mode),
the study's routing (entropy above 2 nats, span 1) on the alias and the rule per request.

    .venv/bin/python -m eval.studies.combine.api_check --rows 100:110

Each held-out CommonsenseQA question is asked once per rule with the openai SDK; the answer's text,
whether it is right and `usage.routing` (calls, `combined`) are written to
results/combine/reference/api.jsonl, and a table beside the in-process study's answer to the same
question under the same rule (results/combine/reference/combined/) is printed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from adapters.model_files import resolve_model
from bench.support import gateway_config, live_gateway, upstream_server
from eval.studies.combine.combine_study import RESULTS, RULES, data_path
from fitting.answers import score
from fitting.datasets import Item, load_items
from fitting.records import read_records, records_path

LOCAL, UPSTREAM = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"
CONFIG = "entropy@2.0"


def reference_config(api_base: str, threads: int) -> dict[str, Any]:
    """One alias routing as the study's `entropy@2.0` does, the upstream in tokens mode."""
    config = gateway_config(api_base, template_gguf=UPSTREAM, mode="tokens")
    config["models"]["local"] = {"smol": {"gguf": LOCAL, "n_ctx": 2048, "n_threads": threads}}
    config["upstreams"]["up"].update(timeout_s=300, extra_body={})
    config["aliases"]["routed"]["routing"] = {"policy": "entropy", "threshold": 2.0, "span": 1}
    return config


def ask(client: Any, item: Item, rule: str, max_tokens: int) -> dict[str, Any]:
    """One answer under `rule` through the API, as a record."""
    response = client.chat.completions.create(
        model="routed", messages=item.messages, max_tokens=max_tokens, temperature=0,
        extra_body={"routing": {"combine": rule}})
    text, routing = response.choices[0].message.content, response.usage.model_extra["routing"]
    scored = score("csqa", item, text)
    return {"id": item.id, "row": item.row, "rule": rule, "text": text, "correct": scored.correct,
            "upstream_calls": routing["upstream_calls"], "combined": routing.get("combined", {})}


def study_answers(out: Path, rule: str) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in read_records(records_path(out / "combined", "csqa", f"{CONFIG}+{rule}"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="100:110")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS / "reference")
    args = parser.parse_args()
    items = load_items("csqa", data_path("csqa", dev=False), args.rows)
    records = []
    with upstream_server(resolve_model(UPSTREAM, fetch=True), "up", server="llama-server",
                         n_threads=args.threads) as api_base, \
            tempfile.TemporaryDirectory() as tmp, \
            live_gateway(reference_config(api_base, args.threads), Path(tmp)) as gateway:
        client = gateway.client()
        for item in items:
            records += [ask(client, item, rule, args.max_tokens) for rule in RULES]
            print(f"item {item.row} done", flush=True)
    (args.out / "api.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    studied = {rule: study_answers(args.out, rule) for rule in RULES}
    print("| row | rule | right | upstream calls | combined | same text as the in-process study |")
    print("|---|---|---|---|---|---|")
    for r in records:
        same = studied[r["rule"]].get(r["id"], {}).get("text")
        print(f"| {r['row']} | {r['rule']} | {r['correct']} | {r['upstream_calls']} | {r['combined']} | "
              f"{'-' if same is None else same == r['text']} |")


if __name__ == "__main__":
    main()
