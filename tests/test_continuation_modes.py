"""Chat continuations joined to the partial answer with words kept whole, against provider-shaped
chat servers on loopback, reached through litellm as any provider is."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from gateway.runtime import make_upstream
from gateway.settings import UpstreamSettings
from tests.conftest import SMOL
from tests.fakes import JsonProvider, serve

QUESTION = [{"role": "user", "content": "Who is at the desk?"}]
WHOLE = "The computer user, working late, typed:\n1. Save the file (B. backup) to NASA; see os.path.join."


class Provider(JsonProvider):
    """A chat-completions provider that knows the whole answer (`WHOLE`) and, asked to continue a
    partial one (the last assistant message), answers up to `max_tokens` words of the rest the way
    a chat model does: as a message of its own, which starts without a space; or, with `echo`, the
    partial answer first and the rest after it (llama-server's prefill, or a model that repeats)."""

    echo = False

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        partial = next((m["content"] for m in reversed(body["messages"]) if m["role"] == "assistant"), "")
        assert WHOLE.startswith(partial), partial
        words = re.findall(r"\s*\S+", WHOLE[len(partial):])[: body["max_tokens"]]
        rest = "".join(words)
        self.answer(self.content(partial, rest, body["max_tokens"]), body["model"], len(words),
                    partial + rest == WHOLE)

    def content(self, partial: str, rest: str, max_tokens: int) -> str:
        return partial + rest if self.echo else rest.lstrip(" ")

    def answer(self, content: str, model: str, words: int, finished: bool) -> None:
        reply = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": model,
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                              "finish_reason": "stop" if finished else "length"}],
                 "usage": {"prompt_tokens": 10, "completion_tokens": words, "total_tokens": 10 + words}}
        self.send_json(reply)


class Echoing(Provider):
    echo = True


class Repeating(Provider):
    """A chat model that repeats the partial answer's last word, then continues."""

    def content(self, partial: str, rest: str, max_tokens: int) -> str:
        return partial.split()[-1] + rest


class Restarting(Provider):
    """A chat model that, asked to continue, answers again from the start (`max_tokens` words of it)."""

    def content(self, partial: str, rest: str, max_tokens: int) -> str:
        return "".join(re.findall(r"\s*\S+", WHOLE)[:max_tokens])


@pytest.fixture(scope="module")
def fresh() -> Iterator[str]:
    yield from serve(Provider)


@pytest.fixture(scope="module")
def echoing() -> Iterator[str]:
    yield from serve(Echoing)


@pytest.fixture(scope="module")
def repeating() -> Iterator[str]:
    yield from serve(Repeating)


@pytest.fixture(scope="module")
def restarting() -> Iterator[str]:
    yield from serve(Restarting)


async def continued(api_base: str, mode: str, partial: str, words: int = 2, template: str | None = None) -> str:
    """The partial answer and what one hand-off of `words` tokens adds to it, as the client sees it."""
    upstream = make_upstream("up", UpstreamSettings(model="openai/x", api_base=api_base, mode=mode, retries=0,
                                                    template_gguf=template))
    handoff = upstream.with_answer(upstream.handoff(QUESTION), partial)
    return partial + (await upstream.continue_text(handoff, words, 0.0, 1.0, None)).text


# partial answer -> the answer after a two-word hand-off, whole words and marks as `WHOLE` has them
TYPED = "The computer user, working late, typed:"
JOINS = {
    "The": "The computer user,",  # a reply without the space its first word had
    "The computer user, working": TYPED,
    "The comp": "The computer user,",  # a hand-off inside a word: the rest of it is glued
    "The computer user": "The computer user, working",  # a reply that starts with a mark keeps it
    TYPED: TYPED + "\n1. Save",  # a newline too
    TYPED + "\n1.": TYPED + "\n1. Save the",
    TYPED + "\n1. Save the file (B.": TYPED + "\n1. Save the file (B. backup) to",
    TYPED + "\n1. Save the file (B. backup) to NAS": TYPED + "\n1. Save the file (B. backup) to NASA; see",
    TYPED + "\n1. Save the file (B. backup) to NASA; see os.path.": WHOLE,  # a name after a dot
}


@pytest.mark.parametrize("mode", ["chat_fallback", "chat_prefix"])
@pytest.mark.parametrize("template", [None, SMOL])  # litellm's (OpenAI's) tokenizer, or the upstream's own
async def test_a_reply_that_starts_a_message_of_its_own_keeps_words_whole(fresh, mode, template):
    joined = {partial: await continued(fresh, mode, partial, template=template) for partial in JOINS}
    assert joined == JOINS


@pytest.mark.parametrize("mode", ["chat_continue", "chat_prefix"])
async def test_an_echoed_answer_is_dropped_and_its_word_boundary_kept(echoing, mode):
    joined = {partial: await continued(echoing, mode, partial) for partial in JOINS}
    assert joined == JOINS


async def test_a_reply_that_starts_the_answer_again_adds_only_what_is_new(restarting):
    restarted = {partial: await continued(restarting, "chat_fallback", partial, words=3)
                 for partial in ("The", "The comp", "The computer user,", "The computer user, working late,")}
    assert restarted == {"The": "The computer user,", "The comp": "The computer user,",  # its own boundary
                         "The computer user,": "The computer user,",  # nothing new yet
                         "The computer user, working late,": "The computer user, working late,"}


async def test_a_repeated_last_word_is_dropped_however_short(repeating):
    partials = ["The computer", TYPED + "\n1. Save the", TYPED + "\n1.", TYPED + "\n1. Save the file (B."]
    joined = {partial: await continued(repeating, "chat_fallback", partial) for partial in partials}
    assert joined == {"The computer": "The computer user, working",
                      TYPED + "\n1. Save the": TYPED + "\n1. Save the file (B.",
                      TYPED + "\n1.": TYPED + "\n1. Save the",
                      TYPED + "\n1. Save the file (B.": TYPED + "\n1. Save the file (B. backup) to"}
