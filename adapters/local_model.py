"""The local llama.cpp model: its vocabulary and chat template, and the batched engine that decodes.

Tokenizing and detokenizing read only the vocabulary and are safe on any thread (a long prompt
takes a second: tokenize it off the event loop). Each such call, and each check of a grammar the
model handed out, counts as a call in flight on the model, on whichever thread makes it, and
`close` frees the model only once none is left: a request cancelled while its worker thread still
tokenizes gives its hold back at once (gateway/runtime.py), but its thread runs the call to its
end, on a model a reload may have dropped meanwhile. Decoding goes
through the engine (adapters/engine.py): each request takes a sequence of its own with
`sequence(prompt)`, and `Sequence.forward(tokens)` makes that sequence hold exactly `tokens` and
returns the next-token logits, re-using the longest common prefix already in the KV cache; that
one primitive is prefill, append, rewind and prefix reuse at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama

from adapters.chat_template import ChatTemplate
from adapters.engine import ContextOverflow, Engine, Sequence
from adapters.grammar import Grammar
from adapters.slot_queue import Claim, QueueFull
from adapters.steering import Steering, SteeringError
from adapters.vocabulary import token_piece, tokenize_parts

__all__ = ["Claim", "ContextOverflow", "LocalModel", "LocalModelError", "ModelGrammar", "QueueFull", "system_info"]
GRAMMARS_KEPT = 8  # parsed grammars kept for cloning (each holds a vocabulary-sized array)


class LocalModelError(Exception):
    """The local model cannot be loaded or used; the message is one line."""


def system_info() -> str:
    """llama.cpp's own report of the CPU features it was built with and uses."""
    return llama_cpp.llama_print_system_info().decode("utf-8", "replace")


class CallsInFlight:
    """The calls running on a model's weights or vocabulary, on any thread, until it is closed."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running = 0
        self._closed = False

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """Count the block as a call on the model; raises LocalModelError once `close` has begun."""
        with self._changed:
            if self._closed:
                raise LocalModelError("the local model is freed (a reload dropped it, or the gateway stops)")
            self._running += 1
        try:
            yield
        finally:
            with self._changed:
                self._running -= 1
                self._changed.notify_all()

    def close(self) -> None:
        """Refuse new calls and wait until none is running. Blocking: call it off the event loop."""
        with self._changed:
            self._closed = True
            self._changed.wait_for(lambda: self._running == 0)


class ModelGrammar:
    """One answer's grammar state (adapters.grammar.Grammar) as its model hands it out: its checks
    read the model's vocabulary, so each is counted as a call on the model."""

    def __init__(self, grammar: Grammar, calls: CallsInFlight) -> None:
        self._grammar, self._calls = grammar, calls

    def allows(self, answer: list[int], token: int) -> bool:
        """See Grammar.allows."""
        with self._calls.counted():
            return self._grammar.allows(answer, token)

    def mask(self, answer: list[int], logits: np.ndarray) -> np.ndarray:
        """See Grammar.mask (blocking: milliseconds)."""
        with self._calls.counted():
            return self._grammar.mask(answer, logits)

    def accepted(self, answer: list[int], tokens: list[int]) -> int:
        """See Grammar.accepted."""
        with self._calls.counted():
            return self._grammar.accepted(answer, tokens)

    def close(self) -> None:
        """Free the parse state; it reads no vocabulary, so this is safe after the model is freed."""
        self._grammar.close()


class LocalModel:
    """A GGUF model: vocabulary, chat template and the engine that decodes its sequences."""

    def __init__(self, llm: Llama, engine: Engine) -> None:
        self._llm = llm
        self.engine = engine
        self._piece_cache: dict[int, bytes] = {}
        self.template = ChatTemplate.from_llama(llm)
        self.n_ctx = engine.n_ctx
        self.n_vocab = llm.n_vocab()
        self.n_embd = engine.n_embd  # size of the hidden state a `hidden` sequence reports
        vocab = llm._model.vocab  # noqa: SLF001 - needed for llama_vocab_is_eog
        self._eog = {t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)}
        eos = llama_cpp.llama_vocab_eos(vocab)
        self.end_token = eos if eos in self._eog else min(self._eog)  # one end-of-generation token
        self._vocab = vocab
        self._grammars: dict[str, Grammar] = {}  # parsed once, cloned per answer; most recent last
        self._grammars_lock = threading.Lock()
        self._calls = CallsInFlight()

    @classmethod
    async def load(cls, path: Path, n_ctx: int, n_threads: int, n_batch: int, queue_limit: int,
                   parallel: int = 1, look_ahead: bool = True, flash_attn: bool = True,
                   steering: Steering | None = None) -> "LocalModel":
        """Load `path` (off the event loop) with an engine of `parallel` sequences of `n_ctx`
        tokens each, evaluating greedy sequences' next tokens ahead if `look_ahead`, with llama.cpp's
        flash attention if `flash_attn`, its context steered by `steering` if given. Raises
        LocalModelError with one line (a steering vector of another width or layer count too)."""

        def build() -> LocalModel:
            # This Llama's own context stays tiny: the engine decodes in a context of its own.
            llm = Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=n_threads,
                        n_threads_batch=n_threads, logits_all=False, verbose=False)
            try:
                engine = Engine(llm, n_ctx, parallel, n_threads, n_batch, queue_limit, flash_attn, steering)
            except BaseException:
                llm.close()  # a refused engine (a reload's) must not keep the weights
                raise
            engine.speculation = look_ahead
            return cls(llm, engine)

        try:
            return await asyncio.to_thread(build)
        except (ValueError, RuntimeError, SteeringError) as exc:
            raise LocalModelError(f"cannot load model {path}: {exc}") from exc

    def close(self) -> None:
        """Free the engine and the weights once no call on them is in flight (on any thread; later
        calls raise LocalModelError). Blocking: call it off the event loop."""
        self._calls.close()
        self.engine.close()
        self._llm.close()

    @property
    def step_s(self) -> float | None:
        """Recent seconds of one decode step; None before the first."""
        return self.engine.step_s

    @property
    def queue_depth(self) -> int:
        return self.engine.queue_depth

    def check_admission(self) -> None:
        """Raise QueueFull when a new request would wait behind too many others."""
        self.engine.check_admission()

    def sequence(self, prompt: list[int], scope: str = "", hidden: bool = False, speculate: bool = False,
                 claim: Claim | None = None) -> contextlib.AbstractAsyncContextManager[Sequence]:
        """A sequence of the engine for one request in cache `scope`, with the last hidden state
        at each step if `hidden`, evaluating greedy next tokens ahead if `speculate`, shared fairly
        with other claims (see Engine.sequence)."""
        return self.engine.sequence(prompt, scope, hidden, speculate, claim)

    # -- tokens and text (read-only on the vocabulary: safe outside the engine) --

    def tokenize_prompt(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Tokens of a rendered prompt (see `tokenize_parts`)."""
        with self._calls.counted():
            return tokenize_parts(self._llm, parts)

    def tokenize_text(self, data: bytes) -> list[int]:
        """Tokens of answer text: no BOS, special-token syntax kept as plain text."""
        if not data:
            return []
        with self._calls.counted():
            return self._llm.tokenize(data, add_bos=False, special=False)

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token (cached after the first call)."""
        piece = self._piece_cache.get(token)
        if piece is None:
            with self._calls.counted():
                piece = token_piece(self._llm, token)
            self._piece_cache[token] = piece
        return piece

    def grammar(self, gbnf: str) -> ModelGrammar:
        """A fresh parse state of `gbnf` over this model's vocabulary (raises GrammarUnsupported).
        The last GRAMMARS_KEPT grammars are parsed once and cloned after that, so a request's `n`
        choices and repeated schemas parse once. Blocking: call it off the event loop."""
        with self._calls.counted(), self._grammars_lock:
            parsed = self._grammars.pop(gbnf, None) or Grammar(self._vocab, self.n_vocab, gbnf)
            self._grammars[gbnf] = parsed
            if len(self._grammars) > GRAMMARS_KEPT:
                self._grammars.pop(next(iter(self._grammars))).close()
            return ModelGrammar(parsed.clone(), self._calls)

    def is_end_of_generation(self, token: int) -> bool:
        return token in self._eog
