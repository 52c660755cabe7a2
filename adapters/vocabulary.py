"""An upstream model's vocabulary and chat template, read from its GGUF (no weights loaded).

With it the gateway renders and tokenizes prompts exactly as that model would, so a hand-off can
send token ids (tokens mode) and billed prompt tokens can be reserved exactly.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
from llama_cpp import Llama

from adapters.chat_template import ChatTemplate


def tokenize_parts(llm: Llama, parts: list[tuple[str, bool]]) -> list[int]:
    """Tokens of a prompt from `ChatTemplate.render_parts`: BOS if the model wants one, control
    tokens parsed in the template's own text only, message content tokenized as plain text."""
    tokens: list[int] = []
    for index, (text, is_content) in enumerate(parts):
        tokens += llm.tokenize(text.encode("utf-8"), add_bos=index == 0, special=not is_content)
    return tokens


def token_piece(llm: Llama, token: int) -> bytes:
    """The bytes of one token, however long. llama-cpp-python's `detokenize` reads at most 32 and
    gives b"" for longer pieces (Qwen2.5 has runs of 33 to 80-odd spaces), which lost an answer's
    text and let its tokens part from its bytes."""
    vocab, size = llm._model.vocab, 64  # noqa: SLF001 - llama.cpp's vocabulary handle
    while True:
        buffer = (ctypes.c_char * size)()
        written = llama_cpp.llama_token_to_piece(vocab, llama_cpp.llama_token(token), buffer, size, 0, False)
        if written >= 0:
            return bytes(buffer[:written])
        size = -written  # the size it needs


class Vocabulary:
    """Tokenize for one model. Read-only after loading: safe to share and to use on the event loop."""

    def __init__(self, gguf: Path) -> None:
        self._llm = Llama(str(gguf), vocab_only=True, verbose=False)
        self.template = ChatTemplate.from_llama(self._llm)

    def prompt_ids(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Tokens of a rendered prompt (see `tokenize_parts`)."""
        return tokenize_parts(self._llm, parts)

    def text_ids(self, data: bytes) -> list[int]:
        """Tokens of answer text: no BOS, control-token syntax kept as plain text."""
        return self._llm.tokenize(data, add_bos=False, special=False) if data else []

    def token_bytes(self, token: int) -> bytes:
        return token_piece(self._llm, token)

    def count(self, text: str) -> int:
        """Tokens of `text` as a text prompt (control-token strings parsed, BOS added)."""
        return len(self._llm.tokenize(text.encode("utf-8"), add_bos=True, special=True))
