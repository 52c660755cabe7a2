"""Per-layer hidden states of a prompt's last token, read from llama.cpp's graph as it computes.

llama.cpp names each layer's output tensor "l_out-<il>" (the residual stream after the layer's
feed-forward block, where a control vector is added) and the final-norm output "result_norm".
A context created with an eval callback (llama_context_params.cb_eval) is asked, node by node,
whether the caller wants a tensor and then handed it once computed, as llama.cpp's
cvector-generator reads them. The callback copies the last row of each: the prompt's last token
(the last layer keeps only the rows that output logits, and only the last token does here).

`HiddenStates` is the seam: a GGUF opened for reading its layers, with the chat template and the
tokenizer its prompts are rendered with. The fitting tools (`python -m gateway steer`, fitting/)
use it and never reach llama.cpp's C interface or llama-cpp-python's internals themselves.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from types import TracebackType
from typing import Self

import llama_cpp
import numpy as np
from llama_cpp import Llama
from llama_cpp import _internals as internals

from adapters.chat_template import ChatTemplate
from adapters.vocabulary import tokenize_parts

LAYER_PREFIX = b"l_out-"
FINAL_NORM = b"result_norm"
GGML_TYPE_F32 = 0
UBATCH = 512  # tokens per graph: bounds the compute buffers (the output layer's included)


class HiddenStates:
    """A GGUF opened to read, for a prompt, its last token's output at every layer (`states`).

    Prompts are rendered with `template` (ChatTemplate.render_parts) and tokenized with
    `tokenize_prompt` exactly as the gateway's local engine tokenizes them. Not thread-safe: one
    prompt at a time. Close it, or use it as a context manager."""

    def __init__(self, path: str | Path, n_threads: int = 1, n_ctx: int = 2048) -> None:
        self._llm = Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=n_threads,
                          n_threads_batch=n_threads, verbose=False)
        try:
            self.template = ChatTemplate.from_llama(self._llm)
            self._layers = LayerStates(self._llm, n_ctx, n_threads)
        except BaseException:
            self._llm.close()
            raise
        self.n_layer, self.n_embd, self.n_ctx = self._layers.n_layer, self._layers.n_embd, n_ctx

    def tokenize_prompt(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Tokens of a prompt from `template.render_parts` (adapters.vocabulary.tokenize_parts)."""
        return tokenize_parts(self._llm, parts)

    def states(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(float32 [n_layer, n_embd]: each layer's output at the last token, float32 [n_embd]: the
        final norm's output there). Raises ValueError for a sequence that does not fit."""
        return self._layers.states(tokens)

    def close(self) -> None:
        self._layers.close()
        self._llm.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


class _TensorHead(ctypes.Structure):
    """The leading fields of ggml.h's struct ggml_tensor (its layout is stable across versions)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4)]


def _ggml_base() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_get_name.restype, lib.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return lib


class LayerStates:
    """A llama.cpp context of its own over a loaded model that returns, for a token sequence, the
    last token's output of every layer. Not thread-safe; one prompt at a time."""

    def __init__(self, llm: Llama, n_ctx: int = 2048, n_threads: int = 1) -> None:
        model = llm._model.model  # noqa: SLF001 - the model's shape
        self.n_layer = llama_cpp.llama_model_n_layer(model)
        self.n_embd = llama_cpp.llama_model_n_embd(model)
        self._ggml = _ggml_base()
        self._layers = np.zeros((self.n_layer, self.n_embd), dtype=np.float32)
        self._final = np.zeros(self.n_embd, dtype=np.float32)
        self._seen: set[int] = set()
        self._callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_tensor)  # kept: C holds it
        params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
        params.n_ctx = params.n_batch = n_ctx
        params.n_ubatch = min(n_ctx, UBATCH)  # a longer prompt is split; its last split's rows come last
        params.n_threads = params.n_threads_batch = n_threads
        params.embeddings = False
        params.cb_eval, params.cb_eval_user_data = self._callback, None
        self._context = internals.LlamaContext(model=llm._model, params=params, verbose=False)  # noqa: SLF001
        self._batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)
        self.n_ctx = n_ctx

    def states(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(float32 [n_layer, n_embd]: each layer's output at the last token, float32 [n_embd]: the
        final norm's output there, what the output layer reads). Raises ValueError for a sequence
        that does not fit."""
        if not 0 < len(tokens) <= self.n_ctx:
            raise ValueError(f"{len(tokens)} tokens do not fit a capture context of {self.n_ctx}")
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._context.ctx), True)
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = token, i, 1, 0
            batch.logits[i] = i == len(tokens) - 1
        self._seen.clear()
        if llama_cpp.llama_decode(self._context.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed while capturing hidden states")
        if len(self._seen) != self.n_layer + 1:
            raise RuntimeError(f"captured {len(self._seen)} of {self.n_layer} layers and the final norm: this model's "
                               "graph does not name its layer outputs l_out-<il>")
        return self._layers.copy(), self._final.copy()

    def close(self) -> None:
        llama_cpp.llama_batch_free(self._batch)
        self._context.close()

    def _on_tensor(self, tensor: int, ask: bool, _user: int) -> bool:
        name = self._ggml.ggml_get_name(tensor) or b""
        wanted = name.startswith(LAYER_PREFIX) or name == FINAL_NORM
        if ask or not wanted:
            return wanted if ask else True
        head = _TensorHead.from_address(tensor)
        rows = head.ne[1] * head.ne[2] * head.ne[3]
        if head.type != GGML_TYPE_F32 or head.ne[0] != self.n_embd or rows == 0:
            return True  # a batch split's last layer with no output rows
        into = self._final if name == FINAL_NORM else self._layers[int(name[len(LAYER_PREFIX):])]
        offset = (rows - 1) * head.nb[1]
        self._ggml.ggml_backend_tensor_get(tensor, into.ctypes.data, offset, self.n_embd * 4)
        self._seen.add(-1 if name == FINAL_NORM else int(name[len(LAYER_PREFIX):]))
        return True
