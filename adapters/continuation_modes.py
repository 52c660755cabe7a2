"""How a partial answer is continued, one class per provider form (`upstreams.<key>.mode`).

- tokens:        /v1/completions on token ids of the upstream's own chat template (llama-server,
                 vLLM). A request's hand-offs extend one id sequence: only text new since the last
                 hand-off is tokenized, so the server's prefix cache holds everything sent before
                 and it evaluates only the new tokens.
- completions:   raw /v1/completions on a prompt rendered with the upstream's own chat template
                 (vLLM, llama.cpp servers, llama-cpp-python's server).
- chat_continue: chat with a trailing assistant message and `continue_final_message: true,
                 add_generation_prompt: false` (vLLM, and this gateway itself).
- chat_prefix:   chat with a trailing assistant message marked `prefix: true` (DeepSeek, Mistral).
- chat_fallback: chat-only providers: ask to repeat the answer's end, then continue; keep only
                 what follows that echo (a reply without it answers afresh and adds nothing).

A chat reply is joined to the answer so that words stay whole (`ChatMode.join`): a server that
prefills the answer (llama-server) sends it back before the continuation, and a reply that starts
a message of its own has lost the space its first word had (`restore_space`); a chat_fallback
reply's echo carries the word boundary with it.

A mode builds hand-offs and makes the one litellm call of each; the `Upstream` around it owns
retries, the circuit breaker, cache isolation, usage and prices.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from adapters.litellm_client import litellm
from adapters.vocabulary import Vocabulary

FALLBACK_INSTRUCTION = "Continue your previous answer exactly where it stopped."
REPEAT_END = ' Start your reply with the text it ends with, "{end}", then write what follows it, and nothing else.'
MAX_END_CHARS = 24  # the longest answer end a chat_fallback reply is asked to repeat (a long word's tail)


@dataclass(frozen=True)
class Alternatives:
    """A continuation's first token as the upstream wrote it (`token`, its bytes) and the upstream's
    likeliest tokens at that position (`top`: bytes and log-probability, likeliest first)."""

    token: bytes
    top: tuple[tuple[bytes, float], ...]


@dataclass(frozen=True)
class Handoff:
    """One question to the upstream: continue `answer` after `messages`.

    `prefix` is the conversation as this upstream sees it (its own chat template in completions
    mode), rendered once per request by the mode's `handoff`; `answer` is set per hand-off by
    `with_answer` (and `alternatives` per call, see adapters.upstream.Upstream.continue_text). Both
    are already neutralized (control-token strings broken), except in tokens
    mode, where content is tokenized as plain text instead and `prefix_ids` / `answer_ids` are
    what is sent. `request_key` names the request in providers' cache hints; `scope` is the
    tenant's cache scope, which the upstream's prefix cache is isolated by.
    """

    prefix: str
    messages: list[dict[str, Any]]
    answer: str = ""
    continue_final: bool = False
    prefix_ids: tuple[int, ...] = ()
    answer_ids: tuple[int, ...] = ()
    request_key: str = ""
    scope: str = "shared"
    alternatives: int = 0  # how many likeliest tokens to ask for at the first position written (0: none)

    @property
    def ids(self) -> list[int]:
        return [*self.prefix_ids, *self.answer_ids]

    @property
    def text(self) -> str:
        """The text the upstream is asked to continue (text modes)."""
        return self.prefix + self.answer


class ContinuingMode:
    """What a mode whose reply always continues the answer shares: nothing is dropped, a call bills
    no more completion tokens than the span it asks for, and text is counted in the provider's tokens."""

    _vocab: Vocabulary | None = None  # the upstream's own tokenizer, where known
    _model = "gpt-4o"  # whose tokenizer litellm counts with where the vocabulary is unknown
    read_ahead: ClassVar[int] = 0  # tokens a call reads past its span unless the upstream says (`read_ahead`)

    def dropped(self, text: str, response: Any) -> bool:
        """Whether the reply was dropped as no continuation (see ChatFallbackMode): never here."""
        return False

    def completion_tokens(self, handoff: Handoff, span: int) -> int:
        """The most completion tokens a call for `span` answer tokens may bill."""
        return span

    def tokens(self, text: str) -> int:
        """Tokens of `text` as the provider counts them: the upstream's own vocabulary where known,
        else litellm's tokenizer for the model (OpenAI's where it has none of its own)."""
        if self._vocab is not None:
            return len(self._vocab.text_ids(text.encode("utf-8")))
        return litellm().token_counter(model=self._model, text=text)

    def pieces(self, text: str) -> list[str]:
        """`text` in the provider's tokens, each piece whole characters (a character that spans
        tokens goes with the token it ends in)."""
        if self._vocab is not None:
            data = [self._vocab.token_bytes(i) for i in self._vocab.text_ids(text.encode("utf-8"))]
            heads = (b"".join(data[:n]).decode("utf-8", errors="replace") for n in range(1, len(data)))
        else:
            ids = litellm().encode(model=self._model, text=text)
            heads = (litellm().decode(model=self._model, tokens=ids[:n]) for n in range(1, len(ids)))
        ends = [len(head) for head in heads if text.startswith(head)] + [len(text)]
        return [text[start:end] for start, end in zip([0, *ends], ends) if end > start]


class TokensMode(ContinuingMode):
    """Token ids of the upstream's own template; each hand-off extends the request's id sequence."""

    def __init__(self, vocab: Vocabulary) -> None:
        self._vocab = vocab

    def handoff(self, messages: list[dict[str, Any]], continue_final: bool, scope: str) -> Handoff:
        ids = self._vocab.prompt_ids(self._vocab.template.render_parts(messages, continue_final))
        return Handoff("", messages, "", continue_final, prefix_ids=tuple(ids), request_key=uuid.uuid4().hex,
                       scope=scope)

    def text_handoff(self, prompt: str, scope: str) -> Handoff:
        ids = self._vocab.prompt_ids([(prompt, True)])
        return Handoff("", [], "", prefix_ids=tuple(ids), request_key=uuid.uuid4().hex, scope=scope)

    def with_answer(self, handoff: Handoff, answer: str) -> Handoff:
        """Only the new text is tokenized, together with the last id sent (so a boundary that
        merges becomes one token); every earlier id stays as the upstream already holds it."""
        if answer == handoff.answer:
            return handoff
        if not handoff.answer_ids or not answer.startswith(handoff.answer):
            ids = self._vocab.text_ids(answer.encode("utf-8"))
        else:
            last = handoff.answer_ids[-1]
            tail = self._vocab.token_bytes(last) + answer[len(handoff.answer):].encode("utf-8")
            ids = [*handoff.answer_ids[:-1], *self._vocab.text_ids(tail)]
        return dataclasses.replace(handoff, answer=answer, answer_ids=tuple(ids))

    def prompt(self, handoff: Handoff) -> list[int]:
        return handoff.ids

    def prompt_tokens(self, handoff: Handoff) -> int | None:
        return len(handoff.ids)

    gives_alternatives: ClassVar[bool] = True

    async def call(self, handoff: Handoff, common: dict[str, Any], extra_body: dict[str, Any]) -> Any:
        return await litellm().atext_completion(prompt=handoff.ids, extra_body={"cache_prompt": True, **extra_body},
                                                **common)

    def alternatives_params(self, count: int) -> dict[str, Any]:
        """What asks a completion for the first token's `count` likeliest alternatives."""
        return {"logprobs": count}

    def text(self, handoff: Handoff, response: Any) -> str:
        return response.choices[0].text


class TextMode(ContinuingMode):
    """Modes that send text: content and answer arrive neutralized (control-token strings broken)."""

    def __init__(self, neutral: Callable[[str], str], vocab: Vocabulary | None) -> None:
        self._neutral, self._vocab = neutral, vocab

    def handoff(self, messages: list[dict[str, Any]], continue_final: bool, scope: str) -> Handoff:
        messages = [{**m, "content": self._neutral(m["content"])} for m in messages]
        return Handoff(self._prefix(messages, continue_final), messages, "", continue_final,
                       request_key=uuid.uuid4().hex, scope=scope)

    def text_handoff(self, prompt: str, scope: str) -> Handoff | None:
        """Raw text to continue: None, a chat provider continues chats only (see CompletionsMode)."""
        return None

    def _prefix(self, messages: list[dict[str, Any]], continue_final: bool) -> str:
        """A stable serialisation of the conversation, for cache keys and token estimates."""
        return "\x1e".join(f"{m['role']}\x1f{m['content']}" for m in messages) + "\x1d"

    def with_answer(self, handoff: Handoff, answer: str) -> Handoff:
        return dataclasses.replace(handoff, answer=self._neutral(answer))

    def prompt(self, handoff: Handoff) -> str:
        return handoff.text

    def prompt_tokens(self, handoff: Handoff) -> int | None:
        """Exact with the upstream's vocabulary, else unknown."""
        return self._vocab.count(handoff.text) if self._vocab is not None else None


class CompletionsMode(TextMode):
    """The upstream's own chat template rendered as text, continued with /v1/completions."""

    gives_alternatives: ClassVar[bool] = True

    def _prefix(self, messages: list[dict[str, Any]], continue_final: bool) -> str:
        return self._vocab.template.render(messages, continue_final)

    def text_handoff(self, prompt: str, scope: str) -> Handoff:
        return Handoff(self._neutral(prompt), [], "", request_key=uuid.uuid4().hex, scope=scope)

    async def call(self, handoff: Handoff, common: dict[str, Any], extra_body: dict[str, Any]) -> Any:
        return await litellm().atext_completion(prompt=handoff.text, extra_body=extra_body, **common)

    def alternatives_params(self, count: int) -> dict[str, Any]:
        return {"logprobs": count}

    def text(self, handoff: Handoff, response: Any) -> str:
        return response.choices[0].text


class ChatMode(TextMode):
    """Chat providers: the partial answer is a trailing assistant message, marked as the provider
    documents (`answer_messages`), with its cache hints."""

    extra_body: ClassVar[dict[str, Any]] = {}  # what the mode adds to a call that carries an answer
    # whether the reply's first token is the answer's next one, so that its alternatives are too
    gives_alternatives: ClassVar[bool] = False
    restores_space: ClassVar[bool] = False  # whether `join` may put back a space the reply dropped

    def __init__(self, neutral: Callable[[str], str], vocab: Vocabulary | None, model: str) -> None:
        super().__init__(neutral, vocab)
        self._model = model

    async def call(self, handoff: Handoff, common: dict[str, Any], extra_body: dict[str, Any]) -> Any:
        messages, answer = split(handoff)
        added = self.answer_messages(answer) if answer else []
        messages, hints = cache_hints(self._model, messages + added, handoff.request_key)
        return await litellm().acompletion(
            messages=messages, extra_body={**extra_body, **(self.extra_body if answer else {}), **hints}, **common)

    def answer_messages(self, answer: str) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": answer}]

    def alternatives_params(self, count: int) -> dict[str, Any]:
        return {"logprobs": True, "top_logprobs": count}

    def text(self, handoff: Handoff, response: Any) -> str:
        """The text the reply adds to the partial answer, joined as `join` says."""
        return self.join(split(handoff)[1], response.choices[0].message.content or "")

    def join(self, answer: str, reply: str) -> str:
        """What `reply` adds to `answer`: any echo of the answer dropped (`strip`); where a mode's
        reply may start a message of its own (`restores_space`) and repeated nothing, the space
        before its first word is restored."""
        continuation = self.strip(answer, reply)
        if continuation != reply or not self.restores_space:
            return continuation
        return restore_space(answer, reply, self.tokens)

    def strip(self, answer: str, reply: str) -> str:
        """`reply` without the answer it repeats first (llama-server sends back a prefilled answer)."""
        return reply[len(answer):] if answer and reply.startswith(answer) else reply


class ChatContinueMode(ChatMode):
    extra_body = {"continue_final_message": True, "add_generation_prompt": False}
    gives_alternatives = True  # the reply continues the answer's own text


class ChatPrefixMode(ChatMode):
    restores_space = True  # a reply that does not repeat the answer may have lost the space before it

    def answer_messages(self, answer: str) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": answer, "prefix": True}]


class ChatFallbackMode(ChatMode):
    """A chat-only provider asked to continue mostly answers the question afresh instead (a small
    model writes its own option letter after the answer's start: "A" + "B"). So the reply is asked
    to repeat the answer's end first (`answer_end`), and only a reply that does continues it. Each
    call is a new turn, which may restate the answer where one turn would go on with it ("The" +
    "garage is ..." where the same model writes "The" + "correct answer is C."), so a call reads
    ahead by default: the next routed steps take the upstream's own continuation of its text."""

    read_ahead = 8

    async def call(self, handoff: Handoff, common: dict[str, Any], extra_body: dict[str, Any]) -> Any:
        """The span's tokens are asked for after the echo's."""
        common = {**common, "max_tokens": self.completion_tokens(handoff, common["max_tokens"])}
        return await super().call(handoff, common, extra_body)

    def completion_tokens(self, handoff: Handoff, span: int) -> int:
        """The span and the echo of the answer's end before it (billed as the reply's own tokens)."""
        end = answer_end(split(handoff)[1])
        return span + (self.tokens(end) if end else 0)

    def answer_messages(self, answer: str) -> list[dict[str, Any]]:
        end = answer_end(answer)
        instruction = FALLBACK_INSTRUCTION + (REPEAT_END.format(end=end) if end else "")
        return [{"role": "assistant", "content": answer}, {"role": "user", "content": instruction}]

    def strip(self, answer: str, reply: str) -> str:
        """What follows the reply's echo of the answer's end (`echo_length`: it may repeat more, as
        far as the whole answer), with the reply's own word boundary; nothing where it repeats less
        (no continuation). After whitespace the answer's own is kept; after an answer without a
        word (nothing to repeat) the reply is kept as sent."""
        end = answer_end(answer)
        if not end:
            return reply
        body, head = answer.rstrip(), reply.lstrip()
        echoed = echo_length(body, head, len(end))
        if echoed < len(end):
            return ""
        rest = head[echoed:]
        return rest.lstrip() if body != answer else rest

    def dropped(self, text: str, response: Any) -> bool:
        """A reply that added nothing though it said something answered afresh: it ends nothing."""
        return not text and bool(response.choices[0].message.content)


ContinuationMode = TokensMode | CompletionsMode | ChatMode


def mode_for(mode: str, model: str, vocab: Vocabulary | None, neutral: Callable[[str], str]) -> ContinuationMode:
    """The continuation mode named `mode`; tokens and completions need the upstream's vocabulary."""
    if mode in ("tokens", "completions") and vocab is None:
        raise ValueError(f"{mode} mode needs the upstream's vocabulary")
    if mode == "tokens":
        return TokensMode(vocab)
    if mode == "completions":
        return CompletionsMode(neutral, vocab)
    chat = {"chat_continue": ChatContinueMode, "chat_prefix": ChatPrefixMode, "chat_fallback": ChatFallbackMode}
    return chat[mode](neutral, vocab, model)


def gives_alternatives(mode: str) -> bool:
    """Whether a reply in continuation mode `mode` carries its first token's alternatives for the
    answer's next position (tokens, completions, chat_continue): a chat_prefix reply may start a
    message of its own (its first word without the space the answer needs), a chat_fallback one
    repeats the answer's end first."""
    return mode in ("tokens", "completions", "chat_continue")


def first_alternatives(response: Any) -> Alternatives | None:
    """The first token of a response's first choice and its alternatives, from OpenAI's chat shape
    (`logprobs.content`, which llama-server returns for completions too) or the legacy completions
    shape (`logprobs.tokens` / `top_logprobs`); None where the response carries none."""
    logprobs = getattr(response.choices[0], "logprobs", None)
    if logprobs is None:
        return None
    content = _field(logprobs, "content")
    if content:
        first = content[0]
        top = tuple((_token_bytes(t), float(_field(t, "logprob"))) for t in _field(first, "top_logprobs") or ())
        return Alternatives(_token_bytes(first), top) if top else None
    tokens, tops = _field(logprobs, "tokens"), _field(logprobs, "top_logprobs")
    if not tokens or not tops or not tops[0]:
        return None
    top = sorted(((text.encode("utf-8"), float(lp)) for text, lp in tops[0].items()), key=lambda t: -t[1])
    return Alternatives(tokens[0].encode("utf-8"), tuple(top))


def _field(value: Any, name: str) -> Any:
    return value.get(name) if isinstance(value, dict) else getattr(value, name, None)


def _token_bytes(entry: Any) -> bytes:
    """A logprob entry's token as bytes: its `bytes` where given (a token may end inside a character)."""
    raw = _field(entry, "bytes")
    return bytes(raw) if raw else (_field(entry, "token") or "").encode("utf-8")


def split(handoff: Handoff) -> tuple[list[dict[str, Any]], str]:
    """The messages before the assistant's turn, and the whole partial assistant text."""
    messages = [dict(m) for m in handoff.messages]
    if handoff.continue_final:  # the client's own partial assistant message comes first
        return messages[:-1], messages[-1]["content"] + handoff.answer
    return messages, handoff.answer


def cache_hints(model: str, messages: list[dict[str, Any]], key: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """What makes one request's consecutive hand-offs read the provider's prompt cache: Anthropic
    caches up to a `cache_control` mark (set on the last message before the answer); OpenAI and
    Mistral route by `prompt_cache_key`. Other providers cache on their own (or not at all) and
    get nothing they might refuse as unknown."""
    provider = model.split("/", 1)[0]
    if provider == "anthropic":
        marked = [dict(m) for m in messages]
        last = max((i for i, m in enumerate(marked) if m["role"] != "assistant"), default=None)
        if last is not None:
            content = marked[last]["content"]
            marked[last]["content"] = [{"type": "text", "text": content, "cache_control": {"type": "ephemeral"}}]
        return marked, {}
    if provider in ("openai", "mistral"):
        return messages, {"prompt_cache_key": key}
    return messages, {}


def strip_echo(answer: str, text: str, min_overlap: int = 4) -> str:
    """Drop the start of `text` that repeats the end of `answer` (chat-only providers echo it): at
    least `min_overlap` characters, or whole words ("the" in "Save the" + "the file"). A `text`
    that is the start of `answer` is an echo cut short by the span: it adds nothing (a chat model
    asked to continue often answers again from the start)."""
    if answer.startswith(text):
        return ""
    if text.startswith(answer) and answer:
        return text[len(answer):]
    for size in range(min(len(answer), len(text)), 0, -1):
        if answer.endswith(text[:size]) and (size >= min_overlap or whole_words(answer, text, size)):
            return text[size:]
    return text


def echo_length(answer: str, reply: str, min_overlap: int) -> int:
    """How much of `reply`'s start repeats the end of `answer` (`strip_echo`). A reply starts a
    sentence, so its echo may be capitalised ("for" repeated as "For"): that counts where the echo
    is a whole word of the reply ("For a", not the "A" of "After" for an answer ending in "a")."""
    exact = len(reply) - len(strip_echo(answer, reply, min_overlap))
    if exact >= min_overlap:
        return exact
    capitalised = len(reply) - len(strip_echo(folded(answer), folded(reply), min_overlap))
    return capitalised if not reply[capitalised:capitalised + 1].isalnum() else exact


def folded(text: str) -> str:
    """`text` in lower case, character for character (a character whose lower case is longer is kept)."""
    return "".join(c.lower() if len(c.lower()) == 1 else c for c in text)


def answer_end(answer: str) -> str:
    """The end of `answer` a chat_fallback reply is asked to repeat: its last word, at most its last
    MAX_END_CHARS characters; "" for an answer without a word."""
    body = answer.rstrip()
    return body[-MAX_END_CHARS:].split()[-1] if body else ""


def whole_words(answer: str, text: str, size: int) -> bool:
    """Whether the first `size` characters of `text`, which end `answer`, are whole words in both."""
    start = len(answer) - size
    starts = not text[0].isspace() and (start == 0 or answer[start - 1].isspace())
    return starts and (size == len(text) or not text[size].isalnum())


SENTENCE_MARKS = ".,;:!?)]}"  # after these a new word takes a space (`carries_on` says when not)


def restore_space(answer: str, reply: str, tokens: Callable[[str], int]) -> str:
    """`reply` as the continuation of `answer`, when the reply started a message of its own.

    A chat model starts its reply with the first token of a new message, without the leading space
    its first word carries inside a text ("The" + "computer user"). So where the answer ends in a
    letter, digit or closing mark and the reply starts with a letter or digit, the space comes back
    unless the reply carries on the answer's last word (`one_word`, `carries_on`). A reply that
    starts with whitespace or punctuation, and one after whitespace, an opening mark, a quote or a
    hyphen, is kept as sent.
    """
    if not answer or not reply or answer[-1].isspace() or not reply[0].isalnum():
        return reply
    tail, head = answer.split()[-1], reply.split()[0]
    if tail[-1].isalnum():
        return reply if one_word(tail, head, tokens) else " " + reply
    if tail[-1] in SENTENCE_MARKS:
        return reply if carries_on(tail, head) else " " + reply
    return reply


def one_word(tail: str, head: str, tokens: Callable[[str], int]) -> bool:
    """Whether `head` is the rest of the word `tail` ends with: the provider's tokenizer reads them
    as one word (gluing them takes fewer tokens than parting them: "Par" + "is", "photos" +
    "ynthesis"); a capital starts a new word unless it carries on a word in capitals ("NAS" + "A")."""
    if head[0].isupper() and not (tail.isupper() and sum(c.isalpha() for c in tail) > 1):
        return False
    return tokens(f" {tail}{head}") < tokens(f" {tail} {head}")


def carries_on(tail: str, head: str) -> bool:
    """Whether `head` carries on after the mark `tail` ends with: the digits of one number ("3." +
    "5", "1," + "000") or a name after a dot ("os.path." + "join"), not a list's letter ("B." +
    "supermarket") or an abbreviation ("e.g." + "the")."""
    mark, before = tail[-1], tail[:-1]
    if mark in ".," and before[-1:].isdigit() and head[0].isdigit():
        return True
    name = before.rsplit(".", 1)[-1]
    return mark == "." and head[0].islower() and len(name) > 1 and name.isidentifier()
