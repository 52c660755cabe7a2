"""The engine's hidden state: what llama.cpp's own embeddings say for the same tokens, at no cost to logits.

The reference is a separate llama-cpp-python Llama with embeddings on and pooling NONE, whose
`embed()` returns one row per token of a text: the last hidden state (after the final norm) at
each position. The engine computes the same rows in other batch shapes (a prompt, then one token
per step), and llama.cpp's CPU kernels round differently with the shape of a batch (see
tests/test_local_model.py), so rows are compared by their relative difference, with the bound
set from measurement (noted at HIDDEN_NOISE).
"""

from __future__ import annotations

import asyncio

import llama_cpp
import numpy as np
import pytest

from bench.support import greedy, load, prompt
from tests.test_local_model import assert_same_greedy

pytestmark = pytest.mark.integration

TEXT = "The lighthouse keeper climbed the stairs every evening, counting them: one, two, three, four."
HIDDEN_NOISE = 0.05  # |engine - embed()| / |embed()| taken for rounding: measured up to 0.022 (mean 0.006);
# a row one position off differs by 0.6 or more


@pytest.fixture(scope="module")
def reference(smol_path):
    llm = llama_cpp.Llama(model_path=str(smol_path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_NONE,
                          n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1, verbose=False)
    yield llm
    llm.close()


@pytest.fixture
async def local(smol_path):
    model = await load(smol_path)
    yield model
    model.close()


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


async def test_hidden_states_are_llama_cpps_embeddings_of_the_same_tokens(local, reference):
    tokens = reference.tokenize(TEXT.encode())
    rows = np.array(reference.embed(TEXT))
    assert rows.shape == (len(tokens), local.n_embd)
    start = 8
    async with local.sequence(tokens[:start], hidden=True) as sequence:
        for end in range(start, len(tokens) + 1):  # the prompt, then one token per step
            await sequence.forward(tokens[:end])
            assert sequence.hidden.dtype == np.float32 and sequence.hidden.shape == (local.n_embd,)
            assert relative(sequence.hidden, rows[end - 1]) < HIDDEN_NOISE
    async with local.sequence(tokens) as plain:  # a sequence that did not ask gets none
        await plain.forward(tokens)
        assert plain.hidden is None


async def hidden_greedy(local, tokens: list[int], steps: int) -> tuple[list[int], list]:
    """As `greedy`, on a sequence that asks for its hidden state at every step."""
    out, seen = [], []
    async with local.sequence(tokens, hidden=True) as sequence:
        for _ in range(steps):
            seen.append(await sequence.forward(tokens + out))
            assert sequence.hidden is not None
            out.append(int(np.argmax(seen[-1])))
    return out, seen


async def test_a_step_with_hidden_states_has_the_same_logits(local):
    tokens = prompt(local, "Be brief.", "Name three colours.")
    await greedy(local, tokens, 1)  # the prompt stays in the cache: both runs below evaluate the same steps
    plain = await greedy(local, tokens, 16)
    hidden = await hidden_greedy(local, tokens, 16)
    assert hidden[0] == plain[0]
    assert all(np.array_equal(a, b) for a, b in zip(hidden[1], plain[1]))


async def test_a_sequence_asking_for_hidden_states_among_others_disturbs_nobody(local, smol_path):
    solo = await load(smol_path, parallel=1)  # the reference: one sequence at a time, none asks
    try:
        prompts = [prompt(local, "Be brief.", "Name three colours."), prompt(local, "You are a pirate.", "Ahoy?"),
                   prompt(local, "Answer in French.", "What is the capital of Italy?")]
        alone = [await greedy(solo, tokens, 16) for tokens in prompts]
        # the asking sequence's prompt meets the others' prefill: decoded apart, in the same step
        together = await asyncio.gather(hidden_greedy(local, prompts[0], 16), greedy(local, prompts[1], 16),
                                        greedy(local, prompts[2], 16))
        for batched, single in zip(together, alone):
            assert_same_greedy(batched, single)
    finally:
        solo.close()


async def test_teacher_forced_rows_carry_the_analysis_labels_and_features_and_the_hidden_state(
        smol_path, reference, local):
    from fitting.analysis import TeacherForcer
    from fitting.datasets import Item
    from eval.hidden_steps import HiddenForcer
    from policies.learned import FEATURES

    item = Item("q", [{"role": "user", "content": "Count the stairs."}], None)
    answer = reference.tokenize(TEXT.encode(), add_bos=False)
    forcer, analysis = HiddenForcer.load(smol_path, 512, 1), TeacherForcer.load(smol_path, 512, 1)
    try:
        rows, labels = forcer.steps(item, answer)
        record = analysis.analyze(item, answer)
    finally:
        forcer.close()
        analysis.close()
    assert rows.shape == (len(answer), len(FEATURES) + local.n_embd)
    assert "".join(str(int(label)) for label in labels) == record["mismatch"]
    assert np.allclose(rows[:, FEATURES.index("entropy")], record["entropy"], atol=2e-3)
    assert np.allclose(rows[:, FEATURES.index("top1")], record["top1"], atol=2e-3)
    tokens = local.tokenize_prompt(local.template.render_parts(item.messages))
    async with local.sequence(tokens, hidden=True) as sequence:  # what the gateway will read live
        for position in range(len(answer)):
            await sequence.forward(tokens + answer[:position])
            assert relative(rows[position, len(FEATURES):], sequence.hidden) < HIDDEN_NOISE


async def test_an_mlp_router_reads_the_hidden_state_the_engine_returns_while_decoding(local):
    from adapters.memory_store import MemoryStore
    from adapters.store import Limits
    from gateway.decoding.decoder import DecodeRequest, Decoding
    from gateway.decoding.values import RequestRouting
    from gateway.tenancy.budget import HandoffGate, Ledger
    from policies import build_policy
    from policies.learned import FEATURES
    from policies.mlp_router import MlpRouter

    rng = np.random.default_rng(0)
    inputs = len(FEATURES) + local.n_embd
    router = MlpRouter(rng.normal(0, 0.05, (8, inputs)), np.zeros(8), rng.normal(0, 0.1, 8), 0.0,
                       np.zeros(inputs), np.ones(inputs), {0.1: 0.5}, "sha", {})
    scored = []

    class Keeping(type(router)):  # the same router, keeping each step's input
        def score_signal(self, signal):
            scored.append(self.inputs(signal))
            return super().score_signal(signal)

    keeping = Keeping(router.w1, router.b1, router.w2, router.b2, router.mean, router.scale, router.shares, "sha", {})
    policy = build_policy("learned", threshold=2.0, router=keeping)  # never above 1: local
    request = DecodeRequest(messages=[{"role": "user", "content": "Name three colours."}], max_tokens=6,
                            routing=RequestRouting(policy))
    decoding = Decoding(local, None, HandoffGate(Ledger(MemoryStore()), "t", Limits(), allowed=True), request)
    [piece async for piece in decoding.pieces()]
    assert len(decoding.answer_tokens) == 6 and len(scored) == 6
    assert all(x.shape == (inputs,) and np.isfinite(x).all() for x in scored)
    tokens = local.tokenize_prompt(local.template.render_parts(request.messages))
    async with local.sequence(tokens, hidden=True) as sequence:  # the first step's hidden state, again
        await sequence.forward(tokens)
        assert relative(scored[0][len(FEATURES):], sequence.hidden) < HIDDEN_NOISE
