"""Admitting a chat completion request: refused now (never mid-stream), started on the token-level
path (one Decoding per choice), or handed to pass-through when only the upstream can serve it."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from adapters.chat_template import TemplateError
from adapters.continuation_modes import gives_alternatives
from adapters.grammar import GrammarUnsupported, gbnf_for
from adapters.local_model import Claim, QueueFull
from gateway.admission import passthrough
from gateway.admission.limits import admit_rates, admit_tokens, release
from gateway.decoding.cost_ceiling import CostCeiling
from gateway.decoding.decoder import DecodeRequest, Decoding, Piece
from gateway.decoding.logit_rules import LogitRules
from gateway.decoding.passing import Blocker, Passing
from gateway.decoding.values import RequestRouting
from gateway.decoding.signals import Sampling
from gateway.decoding.streams import merged
from gateway.runtime import Alias, ModelHold, Runtime
from gateway.settings import AgreementSettings, RoutingSettings
from gateway.tenancy.budget import HandoffGate
from gateway.tenancy.routing import policy_of, resolve_routing
from gateway.tenancy.tenants import Tenant
from gateway.wire.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, Overloaded, quoted
from gateway.wire.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("gateway.admission.chat")
# Most answers one request decodes at once (choices x agreement samples): more would only queue
# behind each other (the engine hands a request's extra sequences out last: adapters/slot_queue.py).
SEQUENCES_PER_REQUEST = 16


@dataclass
class Admitted:
    """A request that passed admission: everything needed to decode and to answer."""

    id: str
    created: int
    alias: Alias
    tenant: Tenant
    body: ChatCompletionRequest | CompletionRequest
    decodings: list[Decoding]  # one per choice (`n` of each prompt), decoded together
    give_back_slot: Callable[[], Awaitable[None]]  # the tenant's parallel slot
    released: bool = False  # its parallel slot, once
    hold: ModelHold | None = None  # its count on the alias's local model (Runtime.hold)

    def pieces(self) -> AsyncIterator[tuple[int, Piece]]:
        """Every choice's pieces as (choice index, piece), in the order they are decoded; each
        choice decodes in a task of its own that never waits for the client."""
        return merged(*(decoding.pieces() for decoding in self.decodings))

    async def release(self) -> None:
        """Give back the request's parallel slot and its hold on the local model, once, whichever path
        ends the request first."""
        if not self.released:
            self.released = True
            if self.hold is not None:
                self.hold.give_back()
            await self.give_back_slot()


def grammar_of(body: ChatCompletionRequest) -> str | None:
    """The GBNF grammar of the request's response_format (None: free text); raises GrammarUnsupported."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    return gbnf_for(fmt.type, fmt.json_schema.schema_ if fmt.json_schema else None)


def wire_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    # Chat templates of open models know "system" but rarely "developer" (OpenAI's newer name).
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]


async def admit(runtime: Runtime, tenant: Tenant, body: ChatCompletionRequest) -> Admitted | Passing:
    """Refuse now (never mid-stream) whatever this request cannot get; else start it, on the
    token-level path or, when the local model cannot serve it, passed through whole."""
    body.check()  # first: a schema sized to crash a grammar parser goes nowhere, not even upstream
    alias = alias_for(runtime, tenant, body.model)
    hold = runtime.hold(alias.local)  # until the request ends: a reload frees no model a request was admitted on
    blocker = passthrough.blocker_of(body, runtime.settings.server.max_tokens_limit)
    grammar = None
    if blocker is None:
        try:
            grammar = await asyncio.to_thread(parsed_grammar, alias, body)
        except GrammarUnsupported as exc:
            blocker = Blocker("response_format", f"{exc}, and only the upstream model can follow it")
        except BaseException:
            hold.give_back()
            raise
    if blocker is not None:
        hold.give_back()  # passed through whole: the local model has no part in it
        return await passthrough.admit(runtime, tenant, alias, body, blocker)
    return await start(runtime, tenant, alias, body, Prompts(messages=wire_messages(body)), grammar, hold)


def parsed_grammar(alias: Alias, body: ChatCompletionRequest) -> str | None:
    """The request's grammar, parsed by the local model now (and kept: its choices clone it), so that
    one it cannot parse is refused here rather than mid-decode. Blocking: run it off the event loop."""
    gbnf = grammar_of(body)
    if gbnf is not None:
        alias.local.grammar(gbnf).close()
    return gbnf


def alias_for(runtime: Runtime, tenant: Tenant, model: str) -> Alias:
    """The alias `model` names, if this tenant may use it; else 404."""
    alias = runtime.aliases.get(model)
    if alias is None or not tenant.may_use(model):
        raise ModelNotFound(f"The model '{quoted(model)}' does not exist or you do not have access to it.",
                            param="model")
    return alias


@dataclass(frozen=True)
class Prompts:
    """What the choices continue: a chat (`messages`), or raw texts (legacy completions: `n`
    choices of each, in order)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    texts: tuple[str | None, ...] = (None,)


async def start(runtime: Runtime, tenant: Tenant, alias: Alias, body: ChatCompletionRequest | CompletionRequest,
                prompts: Prompts, grammar: str | None = None, hold: ModelHold | None = None) -> Admitted:
    """Start `body` on the token-level path: `body.n` choices of each prompt, decoded together.
    `hold`: the request's count on the alias's local model, taken as its alias was picked (taken now
    if None); given back if it is refused, else as the Admitted is released."""
    hold = runtime.hold(alias.local) if hold is None else hold
    try:
        admitted = await _started(runtime, tenant, alias, body, prompts, grammar)
    except BaseException:
        hold.give_back()
        raise
    admitted.hold = hold
    return admitted


async def _started(runtime: Runtime, tenant: Tenant, alias: Alias, body: ChatCompletionRequest | CompletionRequest,
                   prompts: Prompts, grammar: str | None) -> Admitted:
    """`start`'s work. Rate limits come first: nothing is tokenized for a request they refuse, and
    tokenizing (a large prompt takes a second) runs off the event loop."""
    if any(int(token) >= alias.local.n_vocab for token in body.logit_bias or ()):
        raise InvalidRequest(f"logit_bias names a token id outside the local model's vocabulary of "
                             f"{alias.local.n_vocab}", param="logit_bias")
    max_tokens = body.requested_max_tokens or runtime.settings.server.default_max_tokens
    routing = resolve_routing(runtime.routing_of(alias), tenant.settings.routing, body.routing, priced=alias.priced)
    _refuse_uncombinable(alias, routing)
    answers = _answers_per_choice(routing, len(prompts.texts) * body.n)
    try:
        alias.local.check_admission()
    except QueueFull as exc:
        raise Overloaded(f"the local model is busy ({exc}); retry shortly") from exc
    gate = HandoffGate(runtime.ledger, tenant.id, tenant.limits, allowed=tenant.settings.allow_upstream,
                       refusal="budget_exhausted" if tenant.settings.allow_upstream else "upstream_forbidden",
                       cache_scope=tenant.cache_scope, cache_writes=getattr(body, "store", None) is not False)
    kind = "chatcmpl" if isinstance(body, ChatCompletionRequest) else "cmpl"
    request_id = f"{kind}-{uuid.uuid4().hex}"
    await admit_rates(runtime, tenant, gate, request_id)
    claim = Claim(tenant.id, request_id)
    try:
        decodings = await asyncio.to_thread(
            lambda: [_decoding(alias, gate, body, prompts, text, routing, max_tokens, grammar, choice, ceiling, claim)
                     for text, ceiling in _ceilings(alias, routing, prompts) for choice in range(body.n)])
    except BaseException:
        await asyncio.shield(release(runtime, tenant, request_id))
        raise
    prompt_tokens = sum(len(d.prompt_tokens) for d in decodings[::body.n])
    # every answer the request decodes counts, an agreement check's samples too
    await admit_tokens(runtime, tenant, request_id, prompt_tokens + answers * sum(d.limit for d in decodings))
    return Admitted(request_id, int(time.time()), alias, tenant, body, decodings,
                    give_back_slot=lambda: release(runtime, tenant, request_id))


def _refuse_uncombinable(alias: Alias, routing: RoutingSettings) -> None:
    """A 400 for a combine rule the alias's upstream cannot serve: its mode returns no alternatives."""
    if routing.combining.combines and alias.upstream is not None \
            and not gives_alternatives(alias.upstream.settings.mode):
        raise InvalidRequest(f"routing.combine '{routing.combine}' needs the upstream's alternatives, and this "
                             f"model's upstream (mode {alias.upstream.settings.mode}) returns none",
                             param="routing.combine")


def _answers_per_choice(routing: RoutingSettings, choices: int) -> int:
    """Answers each choice decodes (its agreement samples included); 400 for a request that would
    hold more than SEQUENCES_PER_REQUEST sequences of the local model."""
    check = routing.answer_check
    answers = check.samples if isinstance(check, AgreementSettings) else 1
    if choices * answers > SEQUENCES_PER_REQUEST:
        param = "routing.answer_check.samples" if answers > 1 else "n"
        raise InvalidRequest(f"this request would decode {choices * answers} answers at once (choices x agreement "
                             f"samples); at most {SEQUENCES_PER_REQUEST} are allowed", param=param)
    return answers


def _ceilings(alias: Alias, routing: RoutingSettings, prompts: Prompts) -> list[tuple[str | None, CostCeiling | None]]:
    """Each prompt with its cost ceiling, which its choices share (their prompt is billed once)."""
    return [(text, CostCeiling(routing.ceiling, alias.upstream.prices, 0) if alias.upstream else None)
            for text in prompts.texts]


def _decoding(alias: Alias, gate: HandoffGate, body: ChatCompletionRequest | CompletionRequest, prompts: Prompts,
              text: str | None, routing: RoutingSettings, max_tokens: int, grammar: str | None,
              choice: int, ceiling: CostCeiling | None, claim: Claim) -> Decoding:
    """The decoding of one choice; choices differ by seed (seed + choice) when they sample."""
    chat = isinstance(body, ChatCompletionRequest)
    logprobs, top_logprobs = body.token_logprobs()
    request = DecodeRequest(
        messages=prompts.messages, prompt=text, max_tokens=max_tokens, choice=choice, claim=claim,
        routing=_routing(alias, gate, body, routing, ceiling),
        sampling=Sampling(body.temperature, body.top_p), seed=None if body.seed is None else body.seed + choice,
        stop=tuple(body.stop or ()), continue_final=chat and body.continue_final_message,
        logprobs=top_logprobs if logprobs else None, grammar=grammar,
        rules=LogitRules.of(body.presence_penalty, body.frequency_penalty, body.logit_bias),
    )
    try:
        decoding = Decoding(alias.local, alias.continuations, gate, request)
    except TemplateError as exc:
        raise InvalidRequest(str(exc), param="messages") from exc
    if not decoding.prompt_tokens:  # raw text that tokenizes to nothing, for a model without BOS
        raise InvalidRequest("a prompt must hold at least one token", param="prompt")
    if decoding.limit <= 0:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {alias.local.n_ctx} tokens; the "
            f"{'messages' if chat else 'prompt'} use {len(decoding.prompt_tokens)}.",
            param="messages" if chat else "prompt")
    return decoding


def _routing(alias: Alias, gate: HandoffGate, body: ChatCompletionRequest | CompletionRequest,
             routing: RoutingSettings, ceiling: CostCeiling | None) -> RequestRouting:
    """What one choice's answer may ask of the upstream, each rule whole as its routing settings hand it
    out; its answers are rated by the agreement check the routing asks for, else by the alias's check file."""
    windows = alias.windows(gate.tenant)
    return RequestRouting(policy=policy_of(routing, alias.router, windows), handoffs=routing.handoffs,
                          combine=routing.combining, ceiling=ceiling,
                          review=routing.review(alias.answer_check, held=not body.stream),
                          answer_lengths=windows.answer_lengths)
