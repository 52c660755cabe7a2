"""Chat continuations joined to the partial answer with words kept whole, against provider-shaped
chat servers on loopback, reached through litellm as any provider is."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from adapters.continuation_modes import answer_end, mode_for
from adapters.litellm_client import litellm
from adapters.model_files import resolve_model
from adapters.upstream import Upstream
from adapters.vocabulary import Vocabulary
from gateway.runtime import make_upstream
from gateway.settings import UpstreamSettings
from tests.conftest import SMOL
from tests.fakes import JsonProvider, serve

QUESTION = [{"role": "user", "content": "Who is at the desk?"}]
WHOLE = "The computer user, working late, typed:\n1. Save the file (B. backup) to NASA; see os.path.join."
ANOTHER = "B. backup"  # an answer of its own, which no partial answer here begins


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
        self.answer(self.content(partial, rest, body), body["model"], len(words), partial + rest == WHOLE)

    def content(self, partial: str, rest: str, body: dict) -> str:
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
    """A chat model that does as chat_fallback asks: repeats the end of the answer the instruction
    quotes (one token, of the `max_tokens` it may write), then continues with a word a token."""

    def content(self, partial: str, rest: str, body: dict) -> str:
        end = re.search(r'"(.+)"', body["messages"][-1]["content"])[1]
        said = partial.rstrip()
        assert said.endswith(end), end
        return end + "".join(re.findall(r"\s*\S+", WHOLE[len(said):])[: body["max_tokens"] - 1])


class Restarting(Provider):
    """A chat model that, asked to continue, answers again from the start (`max_tokens` words of it)."""

    def content(self, partial: str, rest: str, body: dict) -> str:
        return "".join(re.findall(r"\s*\S+", WHOLE)[: body["max_tokens"]])


class Answering(Provider):
    """A chat model that, asked to continue, writes its own answer instead (`ANOTHER`, as a small
    model writes its option letter after the answer's start)."""

    def content(self, partial: str, rest: str, body: dict) -> str:
        return "".join(re.findall(r"\s*\S+", ANOTHER)[: body["max_tokens"]])


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


@pytest.fixture(scope="module")
def answering() -> Iterator[str]:
    yield from serve(Answering)


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


@pytest.mark.parametrize("template", [None, SMOL])  # litellm's (OpenAI's) tokenizer, or the upstream's own
async def test_a_reply_that_starts_a_message_of_its_own_keeps_words_whole(fresh, template):
    joined = {partial: await continued(fresh, "chat_prefix", partial, template=template) for partial in JOINS}
    assert joined == JOINS


@pytest.mark.parametrize("mode", ["chat_continue", "chat_prefix"])
async def test_an_echoed_answer_is_dropped_and_its_word_boundary_kept(echoing, mode):
    joined = {partial: await continued(echoing, mode, partial) for partial in JOINS}
    assert joined == JOINS


# partial answer (each ends in a one-token word) -> the answer after a two-word chat_fallback hand-off
REPEATED = {
    "The": "The computer user,",
    "The comp": "The computer user,",  # the rest of the word glued
    "The computer user, working ": TYPED,  # after whitespace the answer's own is kept
    TYPED + "\n1. Save the": TYPED + "\n1. Save the file (B.",  # an end shorter than four characters
}


@pytest.mark.parametrize("template", [None, SMOL])
async def test_a_fallback_reply_that_repeats_the_answers_end_continues_it_by_the_span(repeating, template):
    joined = {partial: await continued(repeating, "chat_fallback", partial, template=template) for partial in REPEATED}
    assert joined == REPEATED


@pytest.mark.parametrize("provider", ["answering", "fresh"])  # its own answer; a continuation without the echo
async def test_a_fallback_reply_that_does_not_repeat_the_answers_end_adds_nothing(request, provider):
    partials = ["The", "The computer user, working", TYPED + "\n1. Save the"]
    joined = {partial: await continued(request.getfixturevalue(provider), "chat_fallback", partial)
              for partial in partials}
    assert joined == {partial: partial for partial in partials}


async def test_a_reply_that_starts_the_answer_again_adds_only_what_is_new(restarting):
    restarted = {partial: await continued(restarting, "chat_fallback", partial)
                 for partial in ("The", "The comp", "The computer user, working")}
    assert restarted == {"The": "The computer user,", "The comp": "The computer user,",  # its own boundary
                         "The computer user, working": "The computer user, working"}  # nothing new yet


@pytest.mark.parametrize("template", [None, SMOL])
async def test_a_call_that_reads_ahead_returns_its_span_and_what_follows_apart(repeating, template):
    """Asked for 1 token and 3 more ahead, the reply of a 4-token call: its first token as the
    provider's tokenizer counts it, then the rest in tokens, each of whole characters."""
    upstream = make_upstream("up", UpstreamSettings(model="openai/x", api_base=repeating, mode="chat_fallback",
                                                    retries=0, template_gguf=template))
    handoff = upstream.with_answer(upstream.handoff(QUESTION), "The")
    whole = await upstream.continue_text(handoff, 4, 0.0, 1.0, None)
    read = await upstream.continue_text(handoff, 1, 0.0, 1.0, None, ahead=3)
    assert (read.text, "".join(read.ahead)) == (" computer", whole.text[len(" computer"):]) and not whole.ahead
    assert whole.text == " computer user, working late," and all(read.ahead)
    assert read.completion_tokens == whole.completion_tokens


@pytest.mark.parametrize("template", [None, SMOL])
def test_text_read_ahead_is_split_into_tokens_with_no_character_lost_or_cut(template):
    vocab = Vocabulary(resolve_model(template)) if template else None
    mode = mode_for("chat_fallback", "openai/x", vocab, str)
    text = " naïve café, 日本語 😀 ok"  # characters of two, three and four bytes
    pieces = mode.pieces(text)
    assert "".join(pieces) == text and all(pieces) and len(pieces) > 6
    assert mode.pieces("") == [] and mode.pieces("x") == ["x"]


NEST = "A. bird's nest\n"
# (partial answer, chat_fallback reply) -> what the reply adds
ECHOES = {
    ("A", "A. packaging"): ". packaging",
    ("A", "B"): "",  # a restart: the model's own option letter
    ("A person looking for", "B. compliments"): "",
    ("A person looking for", "For a"): " a",  # the echo capitalised, as a reply's first word is
    ("themselves with creative", "Creative,"): ",",
    ("a puzzle is likely to", "A person"): "",  # a capital is no echo of another word
    ("you might experience a", "After cleaning"): "",  # ... nor the start of one
    ("folding is a specific", "Specifically"): "",
    ("it is not a typ", "typing"): "ing",  # the answer's word finished, as written
    ("The farmer's market is the", "the farmer"): " farmer",  # an exact echo first: not the answer's start again
    ("A B.", "B. C"): " C",
    (TYPED + "\n1.", "1. Save"): " Save",
    ("The co", "computer"): "mputer",  # the whole end repeated, however short
    ("The", "The"): "",  # the end alone: nothing yet
    (NEST, "nest\nExplanation"): "Explanation",
    (NEST, "nest Explanation"): "Explanation",
    ("x" * 30, "x" * 24 + "y"): "y",  # a long word: its tail is the end asked for
    ("\n", "Paris"): "Paris",  # no word to repeat: kept as sent
}


def test_a_fallback_reply_is_kept_from_after_its_echo_of_the_answers_end():
    mode = mode_for("chat_fallback", "openai/x", None, str)
    assert {pair: mode.join(*pair) for pair in ECHOES} == ECHOES
    assert (answer_end("x" * 30), answer_end(NEST), answer_end("\n")) == ("x" * 24, "nest", "")
    assert '"for"' in mode.answer_messages("A person looking for")[-1]["content"]


def test_a_fallback_call_asks_and_reserves_the_echo_beside_the_span():
    upstream = Upstream("up", UpstreamSettings(model="openai/x", mode="chat_fallback"), None)
    handoff = upstream.handoff(QUESTION)
    echo = upstream.estimate_completion_tokens(upstream.with_answer(handoff, "A person looking for"), 2) - 2
    assert echo == litellm().token_counter(model="openai/x", text="for") > 0
    assert upstream.estimate_completion_tokens(handoff, 2) == 2  # no answer yet: nothing to repeat


async def test_a_dropped_fallback_reply_does_not_end_the_answer(answering):
    """The provider stops after its own short answer ("B. backup", finish_reason stop): that ends
    its reply, not the partial answer, which the local model goes on with."""
    upstream = make_upstream("up", UpstreamSettings(model="openai/x", api_base=answering, mode="chat_fallback",
                                                    retries=0))
    partial = WHOLE.removesuffix("os.path.join.")
    continuation = await upstream.continue_text(upstream.with_answer(upstream.handoff(QUESTION), partial), 9,
                                                0.0, 1.0, None)
    assert (continuation.text, continuation.finished) == ("", False)
