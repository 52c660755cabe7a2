"""The batched local engine: one llama.cpp context decodes every request's sequence together.

Each request owns a sequence (a slot) for its lifetime. `Sequence.forward(tokens)` asks the engine
to make that sequence hold exactly `tokens` and returns the next-token logits. One worker thread
runs the step loop: it gathers the forwards of every sequence that is ready, rewinds each one to
its common prefix (removing only that sequence's KV entries), and evaluates them all in one
`llama_decode`: one token per decoding sequence plus a bounded chunk of pending prompt prefill, so
a long prompt never stalls the others. A sequence waiting for its upstream submits nothing (it
leaves the batch, saying so with `pause()`) and its KV entries stay where they are.

Sequences are shared fairly between requests (adapters/slot_queue.py): a request's extra sequences
(its other choices, an agreement check's samples) take a slot only while no other request holds or
waits for one, never the last free one, and while several requests have a sequence ready each step
decodes one of each request's, so a request of sixteen answers slows the others no more than a
request of one.

Finished sequences keep their tokens: a new request takes the free slot that shares the longest
prefix with its prompt, and a longer prefix held by any other sequence (a common system prompt)
is copied with `llama_memory_seq_cp`, which shares the KV cells instead of recomputing them.
Both happen only within one cache scope (a tenant, or the tenants that share): a prompt that
another tenant's cached prefix would have sped up is evaluated in full, so its time to first
token says nothing about what other tenants asked.

A sequence opened with `hidden=True` also gets, with each step's logits, the local model's last
hidden state there (after the final norm: what the output layer reads), for routers that read it.
llama.cpp returns hidden states only from a decode with embeddings on, and such a decode makes
every token of its batch an output (logits included), so embeddings are turned on only for a
decode in which some sequence wants one. When such a sequence's last token meets prefill in a
step, the prefill is decoded first with embeddings off and the wanting sequences' last tokens get
a decode of their own; a step with no such sequence decodes exactly as before.

A sequence opened with `speculate=True` (greedy decoding) does not leave the engine idle while its
request decides on a token: as soon as its logits are out, the engine evaluates the local greedy
token (the argmax) as the sequence's next one, in the next step. If the request's next forward is
exactly that, its logits are ready, or being computed, when it asks; if not (a hand-off, another
choice, the answer's end), the guess is dropped and the forward rewinds past it as usual. One
guess at a time: a guess is extended only once the request has confirmed it. So the hand-over to
the event loop and the decoder's own work per token overlap with the next llama_decode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama
from llama_cpp import _internals as internals
from opentelemetry import trace

from adapters.slot_queue import Claim, SlotQueue
from adapters.steering import Steering

GATHER_S = 0.02  # how long a step waits for sequences that just got logits to come back
SHARE_MIN_TOKENS = 4  # a shorter shared prefix is cheaper to evaluate again than to wait for
IDLE_KEPT = 1  # finished sequences whose tokens stay for reuse: every cell widens every step's attention
THREADPOOL_POLL = 0  # ggml's polling level between graphs: spinning threads would starve the event loop
# on: llama.cpp's auto, as its own tools run (on for CPUs; off where a device cannot run it)
TRACER = trace.get_tracer("adapters.engine")
FLASH_ATTN = {True: llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, False: llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}


class ContextOverflow(Exception):
    """The token sequence does not fit the context window (or the KV cache is full)."""


def common_prefix(held: list[int] | tuple[int, ...], tokens: list[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    if list(tokens[: len(held)]) == list(held):  # the usual case, checked at C speed
        return len(held)
    count, limit = 0, min(len(held), len(tokens))
    while count < limit and held[count] == tokens[count]:
        count += 1
    return count


@dataclass(eq=False)
class Slot:
    """One sequence id of the context. `held`: the tokens whose KV entries it holds (engine thread)."""

    id: int
    held: list[int] = field(default_factory=list)
    owner: object | None = None  # the Sequence using it; None when free
    prompt: int = 0  # its request's prompt length: what is worth keeping once the request ends
    freed_at: float = 0.0
    held_scope: str = ""  # the cache scope whose tokens `held` are (engine thread)
    guess: "_Job | None" = None  # a speculative job evaluated and not yet confirmed (engine thread)
    # whose request holds it (or last held it): the engine thread's copy of what the event loop's
    # SlotQueue records, read by each step's turns
    claim: Claim = field(default_factory=Claim)


@dataclass(eq=False)
class _Job:
    slot: Slot
    owner: object
    tokens: list[int]
    future: concurrent.futures.Future
    scope: str  # its request's cache scope: it shares KV cells only with slots that hold this scope's tokens
    hidden: bool = False  # also return the last hidden state with the logits
    speculate: bool = False  # once done, evaluate the argmax token next (see the module's docstring)
    guess: bool = False  # a speculative job nobody has asked for yet
    todo: list[int] | None = None  # tokens still to evaluate, set when the job starts


class Engine:
    """Owns the llama.cpp context and its step loop; safe to share across requests."""

    def __init__(self, llm: Llama, n_ctx: int, parallel: int, n_threads: int, n_batch: int,
                 queue_limit: int, flash_attn: bool, steering: Steering | None = None) -> None:
        """With `steering`, every sequence decodes with its control vector (adapters/steering.py);
        raises SteeringError for a vector that does not fit the model."""
        self.n_ctx = n_ctx  # per sequence
        self.n_vocab = llm.n_vocab()
        self.n_embd = llama_cpp.llama_model_n_embd_out(llm._model.model)  # noqa: SLF001 - the hidden state's size
        self._context = _batched_context(llm, n_ctx * parallel, parallel, n_threads, n_batch, flash_attn)
        self._ctx = self._context.ctx
        self.steering = steering
        if steering is not None:
            try:
                _steer(self._ctx, llm._model.model, steering)  # noqa: SLF001 - the model's shape
            except Exception:
                self._context.close()
                raise
        self._threadpool = Threadpool(n_threads)
        self._threadpool.attach(self._ctx)
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._embeddings = False  # whether the context's embeddings output is on
        # per-token hidden states need pooling NONE, a generative model's default
        self.hidden_available = llama_cpp.llama_pooling_type(self._ctx) == llama_cpp.LLAMA_POOLING_TYPE_NONE
        self._n_batch = n_batch
        self._slots = [Slot(index) for index in range(parallel)]
        self._queue = SlotQueue(parallel, queue_limit)  # who gets a free slot (adapters/slot_queue.py)
        self._cond = threading.Condition()
        self._pending: list[_Job] = []  # submitted, not yet taken by the loop
        self._expected: set[int] = set()  # slots that got logits and have not come back or paused
        self._closing = False
        self._freed_since_trim = False
        self.steps = 0  # llama_decode calls
        self.step_s: float | None = None  # recent seconds of one decode step (a batch of one token per sequence)
        self.evaluated = 0  # tokens those calls evaluated
        self.speculation = True  # False: sequences opened with `speculate` do not look ahead
        self.guesses_taken = 0  # forwards a speculative job answered
        self.guesses_dropped = 0  # speculative jobs that were not what their request asked next
        self._thread = threading.Thread(target=self._loop, name="llama-engine", daemon=True)
        self._thread.start()

    # -- the request side (event loop) --

    @property
    def queue_depth(self) -> int:
        """Sequences held or waited for."""
        return self._queue.waiting + self._queue.held

    def check_admission(self) -> None:
        """Raise QueueFull when a new request would wait behind too many others."""
        self._queue.check_admission()

    @contextlib.asynccontextmanager
    async def sequence(self, prompt: list[int], scope: str = "", hidden: bool = False,
                       speculate: bool = False, claim: Claim | None = None) -> AsyncIterator["Sequence"]:
        """A sequence of its own for one request in cache `scope`, until the block exits; with
        `hidden`, each forward also sets `Sequence.hidden`; with `speculate`, the engine evaluates
        each greedy next token before it is asked for (see the module's docstring). Sequences of
        one `claim` (a tenant's request) share the engine fairly with others (adapters/slot_queue.py)."""
        if not prompt:  # nothing to decode from: its first step would never produce logits
            raise ValueError("a sequence needs at least one prompt token")
        if hidden and not self.hidden_available:
            raise ValueError("this model pools its embeddings: it has no per-token hidden state to return")
        claim = claim or Claim()
        with TRACER.start_as_current_span("gateway.queue_wait"):  # a span only where tracing is on
            index = await self._queue.take(claim, lambda free: max(
                free, key=lambda i: self._fit(self._slots[i], prompt, scope)))
        slot = self._slots[index]
        sequence = Sequence(self, slot, scope, hidden, speculate)
        slot.owner, slot.prompt, slot.claim = sequence, len(prompt), claim
        try:
            yield sequence
        finally:
            slot.owner, slot.freed_at = None, time.monotonic()
            self._leave(slot, freed=True)
            self._queue.give_back(index)

    @staticmethod
    def _fit(slot: Slot, prompt: list[int], scope: str) -> int:
        """How well a free slot suits a prompt: the prefix it already holds (in this scope), less
        the tokens it would lose (a prefix another request may still want)."""
        shared = common_prefix(slot.held, prompt) if slot.held_scope == scope else 0
        return shared - (len(slot.held) - shared)

    def _submit(self, slot: Slot, owner: object, tokens: list[int], scope: str,
                hidden: bool = False, speculate: bool = False) -> concurrent.futures.Future:
        """A job whose future resolves to (logits, hidden state or None)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._expected.discard(slot.id)
            self._pending.append(_Job(slot, owner, tokens, future, scope, hidden, speculate))
            self._cond.notify()
        return future

    def _leave(self, slot: Slot, freed: bool = False) -> None:
        """The slot's request does not submit for now (or ever, if `freed`): the loop must not wait for it."""
        with self._cond:
            self._expected.discard(slot.id)
            self._freed_since_trim |= freed
            self._cond.notify()

    def forget(self) -> None:
        """Drop the tokens kept by free slots (benchmarks start cold). Call only while idle."""
        with self._cond:
            self._trim_idle(0)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        llama_cpp.llama_batch_free(self._batch)
        self._context.close()
        self._threadpool.free()

    # -- the step loop (engine thread) --

    def _loop(self) -> None:
        active: list[_Job] = []
        while True:
            with self._cond:
                while not (active or self._pending or self._closing):
                    self._cond.wait()
                if self._closing:
                    break
                self._gather()
                for job in self._pending:
                    self._admit(job, active)
                self._pending = []
                trim, self._freed_since_trim = self._freed_since_trim, False
            if trim:  # only after a request ended: not on every step
                self._trim_idle(IDLE_KEPT)
            active = [job for job in active if self._live(job)]
            for job in active:
                if job.todo is None and not self._prefix_coming(job, active):
                    self._rewind(job)
            ready = self._turn([job for job in active if job.todo is not None])
            if ready:
                try:
                    stepped = set(map(id, ready))
                    active = self._step(ready) + [job for job in active if id(job) not in stepped]
                except Exception as exc:  # noqa: BLE001 - the loop must outlive one bad step
                    for job in active:
                        llama_cpp.llama_memory_seq_rm(self._memory, job.slot.id, -1, -1)  # state unknown
                        job.slot.held, job.slot.guess = [], None
                        if not job.future.done():
                            job.future.set_exception(exc)
                    active = []
        for job in active + self._pending:
            job.future.cancel()

    def _turn(self, ready: list[_Job]) -> list[_Job]:
        """The jobs this step decodes: all that are ready, except that while several requests have
        one ready, each request decodes one of its sequences per step (in turn), so a request of
        many answers slows the others no more than a request of one would (adapters/slot_queue.py)."""
        first = ready[0].slot.claim.request if ready else None
        if all(job.slot.claim.request == first for job in ready):  # the usual step: nothing to share
            return ready
        by_request: dict[str, list[_Job]] = {}
        for job in ready:
            by_request.setdefault(job.slot.claim.request, []).append(job)
        return [jobs[self.steps % len(jobs)] for jobs in by_request.values()]

    def _admit(self, job: _Job, active: list[_Job]) -> None:
        """Take a submitted job into `active`, unless a guess of its sequence answers it: a guess
        already evaluated gives its result now; one not yet evaluated is confirmed in its place.
        A guess the job does not match is dropped (the job's rewind undoes its token)."""
        slot, done = job.slot, job.slot.guess
        slot.guess = None
        waiting = next((other for other in active if other.guess and other.slot is slot), None)
        if waiting is not None:
            active.remove(waiting)
            if self._answers(waiting, job):
                self.guesses_taken += 1
                if job.future.set_running_or_notify_cancel():
                    waiting.future, waiting.speculate, waiting.guess = job.future, job.speculate, False
                    active.append(waiting)
                return
        if done is not None and self._answers(done, job):
            self.guesses_taken += 1
            if job.future.set_running_or_notify_cancel():
                job.future.set_result(done.future.result())
                self._after(job, *done.future.result(), active)
            return
        self.guesses_dropped += waiting is not None or done is not None
        active.append(job)

    @staticmethod
    def _answers(guess: _Job, job: _Job) -> bool:
        return guess.tokens == job.tokens and guess.hidden == job.hidden and guess.owner is job.owner

    def _after(self, job: _Job, logits: np.ndarray, hidden: np.ndarray | None, active: list[_Job]) -> None:
        """A job has its result: a confirmed, speculating one starts its guess (its slot is not
        waited for); otherwise the step loop waits briefly for its sequence to come back."""
        if job.guess:
            job.slot.guess = job
        if job.speculate and self.speculation and not job.guess and job.slot.owner is job.owner:
            tokens = [*job.tokens, int(np.argmax(logits))]
            active.append(_Job(job.slot, job.owner, tokens, concurrent.futures.Future(), job.scope, job.hidden,
                               speculate=True, guess=True))
        else:
            self._expected.add(job.slot.id)

    def _gather(self) -> None:
        """Wait (briefly) until every sequence that just got logits has asked for more or paused."""
        deadline = time.monotonic() + GATHER_S
        submitted = {job.slot.id for job in self._pending}
        while self._expected - submitted and not self._closing:
            left = deadline - time.monotonic()
            if left <= 0:
                self._expected.clear()
                return
            self._cond.wait(left)
            submitted = {job.slot.id for job in self._pending}

    def _live(self, job: _Job) -> bool:
        """False for a job whose request has gone (or that cannot fit); marks new jobs running."""
        if job.slot.owner is not job.owner:
            job.future.cancel()
            return False
        if job.todo is None:
            if not job.future.running() and not job.future.set_running_or_notify_cancel():
                return False
            if len(job.tokens) > self.n_ctx:
                job.future.set_exception(ContextOverflow(f"{len(job.tokens)} tokens exceed the context of {self.n_ctx}"))
                return False
        return True

    def _prefix_coming(self, job: _Job, active: list[_Job]) -> bool:
        """Is another job about to evaluate a longer prefix of this one's tokens? Then this one
        waits and copies it (requests arriving together with the same prompt prefill it once)."""
        have = max(self._held_prefix(slot, job) for slot in self._slots)
        return any(other is not job and other.todo and other.scope == job.scope
                   and common_prefix(other.tokens, job.tokens) >= have + SHARE_MIN_TOKENS for other in active)

    @staticmethod
    def _held_prefix(slot: Slot, job: _Job) -> int:
        """The prefix of the job's tokens that `slot` holds and the job may use (same scope)."""
        return common_prefix(slot.held, job.tokens) if slot.held_scope == job.scope else 0

    def _rewind(self, job: _Job) -> None:
        slot, tokens = job.slot, job.tokens
        keep = min(self._held_prefix(slot, job), len(tokens) - 1)  # evaluate at least one token
        donor, shared = None, keep
        if len(tokens) - keep >= SHARE_MIN_TOKENS:
            for other in self._slots:
                length = min(self._held_prefix(other, job), len(tokens) - 1)
                if other is not slot and length >= shared + SHARE_MIN_TOKENS:
                    donor, shared = other, length
        if donor is not None:
            llama_cpp.llama_memory_seq_rm(self._memory, slot.id, -1, -1)
            llama_cpp.llama_memory_seq_cp(self._memory, donor.id, slot.id, 0, shared)
            keep = shared
        else:
            llama_cpp.llama_memory_seq_rm(self._memory, slot.id, keep, -1)
        slot.held, slot.held_scope = tokens[:keep], job.scope
        job.todo = tokens[keep:]

    def _step(self, jobs: list[_Job]) -> list[_Job]:
        """One step over the jobs (one llama_decode, or two when a sequence that wants its hidden
        state meets prefill); returns those with prefill left."""
        wanting = {job for job in jobs if job.hidden}
        if not wanting:
            return self._decode(jobs)
        if all(len(job.todo) == 1 for job in jobs):  # every token is an output anyway
            return self._decode(jobs, embeddings=True)
        # With embeddings on llama.cpp would output (and compute logits for) every prefill token.
        left = self._decode(jobs, hold=wanting)
        last = [job for job in left if job in wanting and len(job.todo) == 1 and not job.future.done()]
        if not last:
            return left
        return self._decode(last, embeddings=True) + [job for job in left if job not in last]

    def _decode(self, jobs: list[_Job], embeddings: bool = False, hold: set[_Job] = frozenset()) -> list[_Job]:
        """One llama_decode over the jobs, except the last token of those in `hold`; returns
        those with tokens left."""
        if embeddings != self._embeddings:
            llama_cpp.llama_set_embeddings(self._ctx, embeddings)
            self._embeddings = embeddings
        placed = self._fill_batch(jobs, hold)
        started = time.perf_counter()
        status = llama_cpp.llama_decode(self._ctx, self._batch)
        if status == 1 and self._trim_idle(0):  # the KV cache is full: drop finished requests' tokens
            self._undo(placed)
            placed = self._fill_batch(jobs, hold)
            started = time.perf_counter()
            status = llama_cpp.llama_decode(self._ctx, self._batch)
        if status == 0 and self._batch.n_tokens == len(placed):  # decode steps only: prefill takes longer
            elapsed = time.perf_counter() - started
            self.step_s = elapsed if self.step_s is None else 0.8 * self.step_s + 0.2 * elapsed
        self.steps += 1
        self.evaluated += self._batch.n_tokens
        if status != 0:
            self._undo(placed)
            error = ContextOverflow(f"llama_decode failed with status {status} (KV cache full?)")
            for job in {job for job, _, _ in placed}:
                job.future.set_exception(error)
            return [job for job in jobs if job not in {j for j, _, _ in placed}]
        guesses: list[_Job] = []
        with self._cond:
            for job, start, index in placed:
                if not job.todo and index is not None:
                    result = (self._logits(index), self._hidden(index) if embeddings and job.hidden else None)
                    job.future.set_result(result)
                    self._after(job, *result, guesses)
        return [job for job in jobs if job.todo] + guesses

    def _fill_batch(self, jobs: list[_Job], hold: set[_Job] = frozenset()) -> list[tuple[_Job, int, int | None]]:
        """Put each job's next tokens in the batch (decode steps first, then prefill chunks), all
        but the last for jobs in `hold`; returns (job, where its tokens started, batch index of
        its logits or None)."""
        batch, budget, placed = self._batch, self._n_batch, []
        batch.n_tokens = 0
        for job in sorted(jobs, key=lambda j: len(j.todo)):
            take = min(len(job.todo) - (job in hold), budget)
            if take == 0:
                continue
            start = len(job.slot.held)
            for offset, token in enumerate(job.todo[:take]):
                i = batch.n_tokens
                batch.token[i], batch.pos[i] = token, start + offset
                batch.n_seq_id[i], batch.seq_id[i][0] = 1, job.slot.id
                batch.logits[i] = offset == take - 1 and take == len(job.todo)
                batch.n_tokens += 1
            job.slot.held += job.todo[:take]
            job.todo = job.todo[take:]
            placed.append((job, start, batch.n_tokens - 1 if not job.todo else None))
            budget -= take
        return placed

    def _undo(self, placed: list[tuple[_Job, int, int | None]]) -> None:
        for job, start, _ in placed:
            job.todo = job.slot.held[start:] + job.todo
            job.slot.held = job.slot.held[:start]
            llama_cpp.llama_memory_seq_rm(self._memory, job.slot.id, start, -1)

    def _trim_idle(self, keep: int) -> bool:
        """Free slots keep only their prompt, and only the `keep` most recently freed keep even
        that; True if a whole slot was emptied."""
        idle = sorted((slot for slot in self._slots if slot.owner is None and slot.held),
                      key=lambda slot: slot.freed_at, reverse=True)
        for index, slot in enumerate(idle):
            kept = slot.prompt if index < keep else 0
            if len(slot.held) > kept:
                llama_cpp.llama_memory_seq_rm(self._memory, slot.id, kept, -1)
                slot.held = slot.held[:kept]
        return len(idle) > keep

    def _logits(self, index: int) -> np.ndarray:
        view = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, index), shape=(self.n_vocab,))
        return view.copy()  # the view is overwritten by the next decode

    def _hidden(self, index: int) -> np.ndarray:
        view = np.ctypeslib.as_array(llama_cpp.llama_get_embeddings_ith(self._ctx, index), shape=(self.n_embd,))
        return view.copy()


class Sequence:
    """One request's sequence in the engine. With `wants_hidden`, `hidden` is the local model's last
    hidden state (float32, n_embd) at the step of the latest forward; otherwise None."""

    def __init__(self, engine: Engine, slot: Slot, scope: str, wants_hidden: bool = False,
                 speculate: bool = False) -> None:
        self._engine, self._slot, self._scope = engine, slot, scope
        self._wants_hidden, self._speculate = wants_hidden, speculate
        self.hidden: np.ndarray | None = None

    async def forward(self, tokens: list[int]) -> np.ndarray:
        """Make the sequence hold `tokens` (a list the caller no longer changes); return the
        logits for the next token (float32)."""
        future = self._engine._submit(self._slot, self, tokens, self._scope, self._wants_hidden, self._speculate)
        logits, self.hidden = await asyncio.wrap_future(future)
        return logits

    def pause(self) -> None:
        """Leave the batch until the next forward (while waiting for an upstream)."""
        self._engine._leave(self._slot)


class _ThreadpoolParams(ctypes.Structure):
    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


class Threadpool:
    """A ggml CPU threadpool that lives as long as the engine. Without one, ggml creates and joins
    a new pool for every llama_decode (llama-cpp-python attaches none): ~1 ms a step here."""

    def __init__(self, n_threads: int, poll: int = THREADPOOL_POLL) -> None:
        self._cpu = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
        self._cpu.ggml_threadpool_params_default.restype = _ThreadpoolParams
        self._cpu.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
        self._cpu.ggml_threadpool_new.restype = ctypes.c_void_p
        self._cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(_ThreadpoolParams)]
        self._cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
        params = self._cpu.ggml_threadpool_params_default(n_threads)
        params.poll = poll
        self.pool = self._cpu.ggml_threadpool_new(ctypes.byref(params))
        if not self.pool:
            raise RuntimeError("ggml_threadpool_new failed")

    def attach(self, ctx) -> None:
        attach = llama_cpp.llama_cpp._lib.llama_attach_threadpool  # noqa: SLF001 - not bound by llama-cpp-python
        attach.argtypes, attach.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], None
        attach(ctx, self.pool, self.pool)

    def free(self) -> None:
        self._cpu.ggml_threadpool_free(self.pool)


def _steer(ctx, model, steering: Steering) -> None:
    """Set the context's control vector (llama.cpp copies the buffer; the range is inclusive)."""
    n_layer, n_embd = llama_cpp.llama_model_n_layer(model), llama_cpp.llama_model_n_embd(model)
    data = steering.control(n_layer, n_embd)
    first, last = steering.layers
    pointer = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    if llama_cpp.llama_set_adapter_cvec(ctx, pointer, data.size, n_embd, first, last) != 0:
        raise RuntimeError("llama_set_adapter_cvec refused the steering vector")


def _batched_context(llm: Llama, n_ctx: int, parallel: int, n_threads: int, n_batch: int,
                     flash_attn: bool) -> internals.LlamaContext:
    """A context over `llm`'s weights holding `parallel` sequences in one unified KV cache (so
    sequences can share prefix cells)."""
    params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
    params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx, parallel, True
    params.n_batch = params.n_ubatch = n_batch
    params.n_threads = params.n_threads_batch = n_threads
    params.flash_attn_type = FLASH_ATTN[flash_attn]
    return internals.LlamaContext(model=llm._model, params=params, verbose=False)  # noqa: SLF001
