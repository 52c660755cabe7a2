"""Teacher-forced steps with the local model's last hidden state: the rows an MLP router learns from.

As fitting/analysis.py's TeacherForcer, the local model reads prompt + the upstream's answer, one
llama.cpp pass per chunk; the answer's positions are read with embeddings on (pooling NONE), so
each gives its logits (the step's FEATURES and the mismatch label, computed as the analysis
computes them) and the hidden state the router reads there. The prompt is read with embeddings
off: on, llama.cpp would compute logits for every prompt token too. A row is FEATURES then the hidden
state, as policies/mlp_router.py serves it. `rows_of` keeps each answer's rows in a cache outside the
repository (they are large and can be made again).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama

from adapters.chat_template import ChatTemplate
from adapters.vocabulary import token_piece, tokenize_parts
from fitting.datasets import Item, load_items
from fitting.records import read_records, records_path
from gateway.decoding.signals import signal_of, token_kind
from policies.learned import FEATURES, features

CACHE_DIR = Path.home() / ".cache" / "routing-gateway" / "hidden-steps"


@dataclass
class HiddenForcer:
    """The local model in its own llama.cpp context, outputting logits and hidden states for every token."""

    llm: Llama
    template: ChatTemplate

    @classmethod
    def load(cls, path: Path, n_ctx: int, threads: int) -> "HiddenForcer":
        batch = min(512, n_ctx)
        llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=batch,
                    n_ubatch=batch, embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_NONE, verbose=False)
        return cls(llm, ChatTemplate.from_llama(llm))

    def close(self) -> None:
        self.llm.close()

    def steps(self, item: Item, reference: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(rows, mismatch labels) of every position of `reference`, the upstream's answer to `item`."""
        llm, ctx = self.llm, self.llm._ctx.ctx  # noqa: SLF001 - decoded here, chunk by chunk
        prompt = tokenize_parts(llm, self.template.render_parts(item.messages))
        tokens = prompt + list(reference)
        if len(tokens) > llm.n_ctx():
            raise ValueError(f"item {item.id}: {len(tokens)} tokens exceed the context of {llm.n_ctx()}")
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        n_vocab, n_embd, kind_of = llm.n_vocab(), llm.n_embd(), lambda t: token_kind(token_piece(llm, t))
        first = len(prompt) - 1  # the position whose logits predict the answer's first token
        llama_cpp.llama_set_embeddings(ctx, False)  # the prompt needs no output: no logits for each of its tokens
        for start in range(0, first, llm.n_batch):
            llm._batch.set_batch(tokens[start:min(first, start + llm.n_batch)], start, False)  # noqa: SLF001
            llm._ctx.decode(llm._batch)  # noqa: SLF001
        llama_cpp.llama_set_embeddings(ctx, True)
        rows, labels = [], []
        for start in range(first, len(tokens) - 1, llm.n_batch):
            chunk = tokens[start:min(len(tokens) - 1, start + llm.n_batch)]
            llm._batch.set_batch(chunk, start, True)  # noqa: SLF001
            llm._ctx.decode(llm._batch)  # noqa: SLF001
            for index in range(len(chunk)):
                position = start + index - first  # the answer token this position predicts
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index), shape=(n_vocab,))
                hidden = np.ctypeslib.as_array(llama_cpp.llama_get_embeddings_ith(ctx, index), shape=(n_embd,))
                rows.append(np.concatenate([features(signal_of(logits, position, kind_of)), hidden]))
                labels.append(float(int(np.argmax(logits)) != reference[position]))
        return np.array(rows, dtype=np.float32).reshape(-1, len(FEATURES) + n_embd), np.array(labels)


def rows_of(forcer: Callable[[], HiddenForcer], run_dir: Path, dataset: str, data: Path | None, rows: str | None,
            cache: Path, config: str = "upstream") -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """(rows, mismatch labels, answer index, the answers' item ids) of every position of the run's
    answers of `config` (the upstream's: mismatch labels; the local model's own: its live inputs),
    cached per answer (`forcer` is called only for answers not in the cache)."""
    references = {r["id"]: r for r in read_records(records_path(run_dir, dataset, config))}
    items = [item for item in load_items(dataset, data, rows) if item.id in references]
    xs, ys, answers = [], [], []
    for index, item in enumerate(items):
        name = f"{dataset}-{item.id}.npz" if config == "upstream" else f"{dataset}-{config}-{item.id}.npz"
        path = cache / run_dir.name / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            x, y = forcer().steps(item, references[item.id]["tokens"])
            np.savez(path, x=x, y=y)
        stored = np.load(path)
        xs.append(stored["x"])
        ys.append(stored["y"])
        answers.append(np.full(len(stored["y"]), index))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(answers), [item.id for item in items]
