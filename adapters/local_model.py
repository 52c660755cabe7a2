"""The local llama.cpp model: one context, owned by one worker thread, leased per request.

A llama.cpp context holds the KV cache of one sequence. Requests take turns through a lease:
the holder decodes a run of local steps, then gives the lease back while it waits for an
upstream, so others can use the model meanwhile. `forward(tokens)` makes the context hold
exactly `tokens` and returns the next-token logits, re-using the longest common prefix already
in the KV cache; that one primitive is prefill, append, rewind and prefix reuse at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama

from adapters.chat_template import ChatTemplate
from adapters.kv_snapshots import KVSnapshots, SnapshotRestoreFailed, common_prefix

SNAPSHOT_MIN_TOKENS = 32  # shorter prefills are cheaper to redo than to snapshot


class LocalModelError(Exception):
    """The local model cannot be loaded or used; the message is one line."""


class QueueFull(Exception):
    """Too many requests are already waiting for the local model."""


class ContextOverflow(Exception):
    """The token sequence does not fit the context window."""


def system_info() -> str:
    """llama.cpp's own report of the CPU features it was built with and uses."""
    return llama_cpp.llama_print_system_info().decode("utf-8", "replace")


def tokenize_parts(llm: Llama, parts: list[tuple[str, bool]]) -> list[int]:
    """Tokens of a prompt from `ChatTemplate.render_parts`: BOS if the model wants one, control
    tokens parsed in the template's own text only, message content tokenized as plain text."""
    tokens: list[int] = []
    for index, (text, is_content) in enumerate(parts):
        tokens += llm.tokenize(text.encode("utf-8"), add_bos=index == 0, special=not is_content)
    return tokens


class LocalModel:
    """A GGUF model served from one llama.cpp context on a dedicated worker thread."""

    def __init__(self, llm: Llama, executor: ThreadPoolExecutor, queue_limit: int, snapshot_bytes: int = 0) -> None:
        self._llm = llm
        self._executor = executor
        self._lock = asyncio.Lock()
        self._waiting = 0
        self._queue_limit = queue_limit
        self._held: list[int] = []  # tokens whose KV entries the context holds
        self._piece_cache: dict[int, bytes] = {}
        self.snapshots = KVSnapshots(snapshot_bytes)
        self.template = ChatTemplate.from_llama(llm)
        self.n_ctx = llm.n_ctx()
        self.n_vocab = llm.n_vocab()
        vocab = llm._model.vocab  # noqa: SLF001 - needed for llama_vocab_is_eog
        self._eog = {t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)}

    @classmethod
    async def load(cls, path: Path, n_ctx: int, n_threads: int, n_batch: int, queue_limit: int,
                   snapshot_bytes: int = 0) -> "LocalModel":
        """Load `path` on a new worker thread. Raises LocalModelError with one line."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama")

        def build() -> Llama:
            return Llama(
                model_path=str(path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                n_batch=n_batch, logits_all=False, verbose=False,
            )

        try:
            llm = await asyncio.get_running_loop().run_in_executor(executor, build)
        except (ValueError, RuntimeError) as exc:
            executor.shutdown(wait=False)
            raise LocalModelError(f"cannot load model {path}: {exc}") from exc
        return cls(llm, executor, queue_limit, snapshot_bytes)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._llm.close()

    @property
    def queue_depth(self) -> int:
        return self._waiting

    def check_admission(self) -> None:
        """Raise QueueFull when a new request would wait behind too many others."""
        if self._waiting >= self._queue_limit and self._lock.locked():
            raise QueueFull(f"{self._waiting} requests are waiting for the local model")

    # -- tokens and text (read-only on the vocabulary: safe outside the worker) --

    def tokenize_prompt(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Tokens of a rendered prompt (see `tokenize_parts`)."""
        return tokenize_parts(self._llm, parts)

    def tokenize_text(self, data: bytes) -> list[int]:
        """Tokens of answer text: no BOS, special-token syntax kept as plain text."""
        return self._llm.tokenize(data, add_bos=False, special=False) if data else []

    def token_bytes(self, token: int) -> bytes:
        piece = self._piece_cache.get(token)
        if piece is None:
            piece = self._llm.detokenize([token])
            self._piece_cache[token] = piece
        return piece

    def is_end_of_generation(self, token: int) -> bool:
        return token in self._eog

    # -- the context --

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator["Lease"]:
        """Exclusive use of the context until the block exits."""
        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
        try:
            yield Lease(self)
        finally:
            self._lock.release()

    def _forward(self, tokens: list[int]) -> np.ndarray:
        if len(tokens) > self.n_ctx:
            raise ContextOverflow(f"{len(tokens)} tokens exceed the context of {self.n_ctx}")
        common = common_prefix(self._held, tokens)
        if len(tokens) - common >= SNAPSHOT_MIN_TOKENS:
            try:
                restored = self.snapshots.restore_best(self._llm.ctx, tokens, common + SNAPSHOT_MIN_TOKENS)
            except SnapshotRestoreFailed:
                restored, common = None, 0  # evaluate everything again: the KV state is unknown
            if restored is not None:
                self._held, common = list(restored), common_prefix(restored, tokens)
        common = min(common, len(tokens) - 1)  # evaluate at least one token to get its logits
        self._held = []  # if eval fails midway, the KV state is unknown
        self._llm.n_tokens = common
        self._llm.eval(tokens[common:])
        self._held = list(tokens)
        if len(tokens) - common >= SNAPSHOT_MIN_TOKENS:  # a prompt prefill: worth keeping
            self.snapshots.save(self._llm.ctx, tokens)
        view = np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(self._llm.ctx, -1), shape=(self.n_vocab,)
        )
        return view.copy()  # the view is overwritten by the next eval


class Lease:
    """Handle on the context while the lease is held; calls run on the model's worker thread."""

    def __init__(self, model: LocalModel) -> None:
        self._model = model

    async def forward(self, tokens: list[int]) -> np.ndarray:
        """Make the context hold `tokens`; return the logits for the next token (float32)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._model._executor, self._model._forward, tokens)
