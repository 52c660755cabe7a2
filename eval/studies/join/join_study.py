"""Issue #63's join study: held-out CommonsenseQA through every continuation mode the embedded
llama-server can be reached in (tokens, completions, chat_continue, chat_fallback), one routing
config, and the words a hand-off's join broke.

    .venv/bin/python -m eval.studies.join.join_study run --rows 0:100 --config entropy@2.5
    .venv/bin/python -m eval.studies.join.join_study report --config entropy@2.5

`run` decodes with the eval harness's own runner (fitting/runner.py): one llama-server (tokens mode,
as `python -m eval run` launches it) reached through a litellm upstream per mode, records written
as `python -m eval run` writes them (results/join/<mode>/csqa__<config>.jsonl, resumable), item by
item through every mode. `local` and `upstream` are decoded once, in tokens/ (or read from
`--plain`). Each routed answer's hand-offs (the end of the answer each continued, the text joined to
it and a chat mode's reply as sent) go to results/join/<mode>/joins.jsonl. Both are gzipped once a
run is done, as results/runs/ are. Chat modes send no template, as an OpenAI user's upstream does.
`--local`, `--upstream` and `--router` (for `learned@S`) pick another pair and router.

`report`: accuracy per mode, paired with tokens mode, and how its hand-offs were joined: those
whose text starts with a letter or digit right after one of the answer's, and of the words across
them those glued (in no question, option, local or upstream-only answer of the slice: texts no join
touched), with the answers holding one; and restarts, hand-offs after a non-empty answer whose text
begins the upstream-only answer again (a chat model answering afresh instead of continuing).
"""

from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]

from adapters.continuation_modes import ChatMode, split
from fitting.configs import parse_config
from fitting.datasets import load_items
from fitting.records import append_record, read_records, records_path
from fitting.runner import RunPlan, run
from fitting.session import ModelOptions, Models, open_models, upstream_settings
from gateway.runtime import make_upstream

RESULTS = ROOT / "results" / "join"
DATA = ROOT / "data" / "commonsenseqa_dev300_rows922-1221.jsonl"  # untouched: nothing fitted or chosen on it
MODES = ("tokens", "completions", "chat_continue", "chat_fallback")
WORD = re.compile(r"[A-Za-z]+")


class Logged:
    """An upstream that notes each continuation it returns: the end of the answer it continued, the
    text joined to it and, from a chat mode, the provider's reply as sent (what a join made of it)."""

    def __init__(self, upstream: Any) -> None:
        self._upstream, self.joins, self._reply = upstream, [], None
        mode = upstream._mode  # the study reads the reply before the mode joins it
        if isinstance(mode, ChatMode):
            joined = mode.text
            def noted(handoff: Any, response: Any) -> str:
                self._reply = response.choices[0].message.content or ""
                return joined(handoff, response)
            mode.text = noted

    def __getattr__(self, name: str) -> Any:
        return getattr(self._upstream, name)

    async def continue_text(self, handoff, *args, **kwargs):
        self._reply = None
        got = await self._upstream.continue_text(handoff, *args, **kwargs)
        log = {"answer_end": split(handoff)[1][-30:], "text": got.text, **({"ahead": "".join(got.ahead)} if got.ahead else {})}
        self.joins.append(log if self._reply is None else {**log, "reply": self._reply})
        return got


def mode_upstream(models: Models, options: ModelOptions, mode: str, read_ahead: int | None) -> Any:
    """The launched server reached in `mode`: tokens as launched; other modes with no template, each
    call reading `read_ahead` tokens past its span."""
    if mode == "tokens":
        return models.upstream
    chat = mode.startswith("chat")
    settings = upstream_settings(options, models.server.api_base, options.upstream).model_copy(update={
        "mode": mode, "model": "openai/eval-upstream" if chat else "text-completion-openai/eval-upstream",
        "template_gguf": None if chat else options.upstream, "read_ahead": read_ahead})
    return make_upstream("eval-upstream", settings)


async def run_modes(args: argparse.Namespace) -> None:
    items = load_items("csqa", DATA, args.rows)
    options = ModelOptions(local=args.local, upstream=args.upstream, threads=args.threads, router=args.router)
    models = await open_models(options, with_upstream=True)
    try:
        upstreams = {mode: Logged(mode_upstream(models, options, mode, args.read_ahead)) for mode in args.modes}
        for item in items:
            for mode, upstream in upstreams.items():
                if mode == "tokens" and not args.plain:  # neither continues a partial answer
                    await run(RunPlan("csqa", [item], [parse_config("local"), parse_config("upstream")],
                                      args.out / mode, args.max_tokens), models)
                plan = RunPlan("csqa", [item], [parse_config(args.config)], args.out / mode, args.max_tokens)
                upstream.joins = []
                await run(plan, Models(**{**vars(models), "upstream": upstream}))
                if upstream.joins:
                    append_record(args.out / mode / "joins.jsonl",
                                  {"id": item.id, "config": args.config, "joins": upstream.joins})
            print(f"item {item.row} done", flush=True)
    finally:
        models.close()


def lexicon(items: list[Any], answers: list[str]) -> set[str]:
    """Every word of the questions, options and the given answers, lower-cased."""
    texts = [m["content"] for item in items for m in item.messages] + answers
    return {w.lower() for text in texts for w in WORD.findall(text)}


def joined_words(joins: list[dict[str, str]]) -> list[str]:
    """The word across each join with no space between two letters or digits."""
    return [re.findall(r"\w+$", j["answer_end"])[0] + re.findall(r"^\w+", j["text"])[0] for j in joins
            if j["answer_end"][-1:].isalnum() and j["text"][:1].isalnum()]


def read_joins(path: Path, wanted: set[str], config: str) -> dict[str, list[dict[str, str]]]:
    """Item id -> the hand-offs of its answer under `config` (the last log of an item wins, as records do)."""
    return {log["id"]: log["joins"] for log in read_records(path) if log["id"] in wanted and log["config"] == config}


def report(args: argparse.Namespace) -> None:
    items = load_items("csqa", DATA, args.rows)
    wanted = {item.id for item in items}
    records = {mode: {r["id"]: r for r in read_records(records_path(args.out / mode, "csqa", args.config))
                      if r["id"] in wanted} for mode in args.modes}
    plain = {name: {r["id"]: r for r in read_records(records_path(args.plain or args.out / "tokens", "csqa", name))
                    if r["id"] in wanted} for name in ("local", "upstream")}
    joins = {mode: read_joins(args.out / mode / "joins.jsonl", wanted, args.config) for mode in args.modes}
    common = sorted(set.intersection(*(set(r) for r in [*records.values(), *plain.values()])))
    words = lexicon(items, [r["text"] for by_id in plain.values() for r in by_id.values()])
    print(f"{len(common)} items answered by every mode; config {args.config}; max_tokens {args.max_tokens}\n")
    print("| mode | accuracy | vs tokens: gained / lost | upstream share of tokens | calls / answer | "
          "joins with no space between letters or digits | glued words (answers) | restarts |")
    print("|---|---|---|---|---|---|---|---|")
    for name, by_id in plain.items():
        print(row(name, by_id, common, None) + " | | | |")
    for mode, by_id in records.items():
        cells = join_cells(joins[mode], common, words, plain["upstream"])
        print(row(mode, by_id, common, records.get("tokens")) + cells)
    for mode in records:
        across = sorted({w for i in common for w in joined_words(joins[mode].get(i, []))})
        print(f"\n{mode}: words across joins with no space: {[(w, w.lower() in words) for w in across]}")


def row(name: str, by_id: dict[str, Any], common: list[str], tokens: dict[str, Any] | None) -> str:
    """Accuracy, paired with tokens mode, the upstream's share of answer tokens (in calls, or read ahead by
    one) and calls per answer."""
    n = len(common)
    right = sum(by_id[i]["correct"] for i in common)
    paired = ""
    if tokens is not None:
        gained = sum(by_id[i]["correct"] and not tokens[i]["correct"] for i in common)
        lost = sum(tokens[i]["correct"] and not by_id[i]["correct"] for i in common)
        paired = f"{gained} / {lost}"
    written = max(1, sum(by_id[i]["answer_tokens"] for i in common))
    read_ahead = sum(by_id[i]["cache_tokens"] for i in common)  # each answer has a cache of its own
    share = (sum(by_id[i]["upstream_tokens"] for i in common) + read_ahead) / written
    calls = sum(by_id[i]["upstream_calls"] for i in common) / max(1, n)
    ahead = f" ({read_ahead / written:.1%} read ahead)" if read_ahead else ""
    return f"| {name} | {right / max(1, n):.1%} ({right}/{n}) | {paired} | {share:.1%}{ahead} | {calls:.2f}"


def join_cells(joins: dict[str, list[dict[str, str]]], common: list[str], words: set[str],
               direct: dict[str, Any]) -> str:
    """Joins with no space between two letters or digits; of their words, those in no text of the
    lexicon (glued: "Thecomputer"), and the answers with one; hand-offs whose text begins the
    upstream-only answer again after a non-empty answer (a chat model answering afresh)."""
    across = {i: joined_words(joins.get(i, [])) for i in common}
    glued = {i: [w for w in found if w.lower() not in words] for i, found in across.items()}
    restarts = sum(bool(j["answer_end"] and j["text"].strip()) and direct[i]["text"].startswith(j["text"].strip())
                   for i in common for j in joins.get(i, []))
    return (f" | {sum(map(len, across.values()))} | {sum(map(len, glued.values()))} "
            f"({sum(bool(g) for g in glued.values())}) | {restarts} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run", "report"])
    parser.add_argument("--rows", default="0:100")
    parser.add_argument("--config", default="entropy@2.5")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--local", default="smollm2-135m-instruct")
    parser.add_argument("--upstream", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--router", help="a learned router file, for learned@S configs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--plain", type=Path, help="where the local and upstream-only records are (default: "
                        "OUT/tokens); run decodes them only where this is not given")
    parser.add_argument("--read-ahead", type=int, help="the upstream's read_ahead in every mode but tokens "
                        "(default: the mode's own, 8 in chat_fallback; the runs before it was built: 0)")
    parser.add_argument("--max-tokens", type=int, default=32)  # CommonsenseQA's cap in the studies
    args = parser.parse_args()
    if args.command == "run":
        asyncio.run(run_modes(args))
    else:
        report(args)


if __name__ == "__main__":
    main()
