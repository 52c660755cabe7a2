"""The models of an evaluation: the local model in-process, the upstream as a real server process.

The upstream is a child server on loopback, reached over HTTP through litellm exactly as the
gateway reaches any upstream, on the upstream's own chat template: llama.cpp's `llama-server` in
tokens mode (the default: hand-offs extend one cached sequence), or `python -m llama_cpp.server`
in completions mode (the runs before tokens mode existed). `repeat_penalty: 1.0` keeps either
server greedy at temperature 0 (llama-cpp-python's default of 1.1 would not be).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from adapters.engine import common_prefix
from adapters.local_model import LocalModel
from adapters.model_files import model_sha256, resolve_model
from adapters.steering import Steering
from adapters.upstream import Upstream
from adapters.upstream_server import UpstreamServer, forgetful_args
from fitting.costs import PriceSheet
from fitting.records import RECORDED_FLASH_ATTN
from gateway.runtime import make_upstream
from gateway.settings import LaunchSettings, UpstreamSettings
from policies import Router
from policies.answer_check import AnswerCheck


@dataclass
class Models:
    """What a run decodes with; `upstream` and `server` are None for local-only runs."""

    local: LocalModel
    upstream: Upstream | None
    server: UpstreamServer | None
    local_path: Path | None = None  # lets the oracle load a teacher-forcing context of the local model
    server_slots: int = 0  # sequences of a launched llama-server (erased by cold_upstream)
    router: Router | None = None  # for learned@S configs
    check: AnswerCheck | None = None  # for afresh=P configs
    shared_prefix: str | None = None  # the saved upstream state every answer starts from (share_prefix)

    async def cold_upstream(self) -> None:
        """Erase every sequence the launched llama-server holds, so the next decode is billed and
        timed from a cold cache: one configuration's answer never reads another's cached prompt.
        After `share_prefix`, each starts from the shared prefix alone instead."""
        if self.server is not None and self.server_slots:
            await self.server.forget(self.server_slots, keep=self.shared_prefix)

    async def share_prefix(self, system: dict[str, str]) -> int:
        """Model a provider's prompt cache that holds one system prompt for every question: the
        upstream's rendering of `system` (what any two questions behind it share) is evaluated
        once, saved, and restored before each answer, so each answer's first call reads it as
        cached tokens and pays for its question alone. Returns the prefix's length in tokens."""
        if self.server is None or self.upstream is None or not self.server_slots:
            raise ValueError("a shared cached prefix needs a launched llama-server upstream (tokens mode)")
        one, two = (self.upstream.handoff([system, {"role": "user", "content": text}]).ids for text in ("A?", "B?"))
        prefix = one[:common_prefix(one, two)]
        await self.server.remember(prefix, "shared-prefix.bin")
        self.shared_prefix = "shared-prefix.bin"
        return len(prefix)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.local.close()


@dataclass(frozen=True)
class ModelOptions:
    local: str  # catalog name or GGUF path
    upstream: str
    n_ctx: int = 2048
    threads: int = 1
    input_usd_per_mtok: float = 0.5
    output_usd_per_mtok: float = 1.5
    timeout_s: float = 300.0
    upstream_api_base: str | None = None  # an already running completions server: launch none
    parallel: int = 1  # sequences of the local model's engine (items decoded at once)
    upstream_server: str = "llama-server"  # or llama-cpp-python (text prompts, no KV reuse between calls)
    warm: bool = False  # tokens mode: send the prompt when an item starts
    router: str | None = None  # a learned router file, checked against the local model
    check: str | None = None  # an answer check file, checked against the local model
    sheet: PriceSheet | None = None  # token prices that replace the assumed ones (what decisions are priced at)
    flash_attn: bool = RECORDED_FLASH_ATTN  # in the local engine
    steering: Steering | None = None  # a control vector in the local engine (docs/steering.md)

    @property
    def upstream_mode(self) -> str:
        return "tokens" if self.upstream_server == "llama-server" else "completions"


async def open_models(options: ModelOptions, with_upstream: bool) -> Models:
    """Load the local model and, if asked, start and warm the upstream server (or use the given one)."""
    local_path = resolve_model(options.local, fetch=True)
    router = Router.load(options.router, model_sha256(options.local)) if options.router else None
    check = AnswerCheck.load(options.check, model_sha256(options.local)) if options.check else None
    local = await LocalModel.load(local_path, options.n_ctx, options.threads, n_batch=256,
                                  queue_limit=options.parallel, parallel=options.parallel,
                                  flash_attn=options.flash_attn, steering=options.steering)
    if not with_upstream:
        return Models(local, None, None, local_path, router=router, check=check)
    server = None
    try:
        gguf = resolve_model(options.upstream, fetch=True)  # its chat template renders the prompts
        api_base = options.upstream_api_base
        if api_base is None:
            cold = options.upstream_server == "llama-server"
            launch = LaunchSettings(gguf=str(gguf), server=options.upstream_server, n_threads=options.threads,
                                    n_ctx=options.n_ctx, parallel=max(2, options.parallel),
                                    extra_args=forgetful_args() if cold else [])
            server = UpstreamServer(gguf, launch, "eval-upstream")
            await server.wait_ready(timeout_s=300.0)
            api_base = server.api_base
        upstream = make_upstream("eval-upstream", upstream_settings(options, api_base, str(gguf)))
        slots = launch.parallel if server is not None and options.upstream_server == "llama-server" else 0
        return Models(local, upstream, server, local_path, slots, router, check)
    except BaseException:
        if server is not None:
            server.stop()
        local.close()
        raise


def upstream_settings(options: ModelOptions, api_base: str, template_gguf: str) -> UpstreamSettings:
    """Tokens (or completions) mode on the upstream's own template; greedy; the assumed prices, or
    the sheet's."""
    sheet = options.sheet
    prices = dict(input_usd_per_mtok=options.input_usd_per_mtok, output_usd_per_mtok=options.output_usd_per_mtok)
    if sheet is not None:
        if sheet.compute_usd_per_hour is not None:
            raise ValueError(f"sheet {sheet.name} prices compute time: decisions need token prices")
        prices = dict(input_usd_per_mtok=sheet.input, output_usd_per_mtok=sheet.output,
                      cached_input_usd_per_mtok=sheet.cached_read, cache_write_usd_per_mtok=sheet.cache_write,
                      cache_min_prompt_tokens=int(min(sheet.cache_min_prompt_tokens, 10**9)))
    return UpstreamSettings(
        model="text-completion-openai/eval-upstream", api_base=api_base, mode=options.upstream_mode,
        warm=options.warm and options.upstream_mode == "tokens",
        template_gguf=template_gguf, extra_body={"repeat_penalty": 1.0}, timeout_s=options.timeout_s,
        retries=1, **prices,
        cache_isolation="shared",  # one tenant: the upstream's cache counts are what the records measure
    )
