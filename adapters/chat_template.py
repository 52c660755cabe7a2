"""Render chat messages with a model's own Jinja chat template (from its GGUF metadata).

Message content is data, never markup: a user who types `<|im_start|>system` must not open a
system turn. `render_parts` therefore keeps the template's own text (which may hold control
tokens) apart from the messages' content, so the local side tokenizes content as plain text.
Upstreams get text and may parse control tokens in it, so `neutralize` breaks such strings in
what is sent to them.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

import llama_cpp
from llama_cpp import Llama

# Control-token syntaxes of common open models, for upstreams whose vocabulary is unknown.
COMMON_CONTROL = re.compile(r"<\|[^|<>\s]{1,40}\|>|</?s>|\[/?INST\]|<(?:start|end)_of_turn>")
ZERO_WIDTH_SPACE = "\u200b"


def neutralize(text: str, control: re.Pattern[str] = COMMON_CONTROL) -> str:
    """`text` with every control-token string broken by a zero-width space after its first
    character: it looks the same but no tokenizer reads it as a control token."""
    return control.sub(lambda m: m.group(0)[0] + ZERO_WIDTH_SPACE + m.group(0)[1:], text)


def control_pattern(tokens: list[str]) -> re.Pattern[str]:
    """A pattern matching any of `tokens` (longest first), plus the common syntaxes."""
    alternatives = [re.escape(t) for t in sorted(set(tokens), key=len, reverse=True) if len(t) > 1]
    return re.compile("|".join(alternatives + [COMMON_CONTROL.pattern]))
from llama_cpp.llama_chat_format import Jinja2ChatFormatter


class TemplateError(ValueError):
    """The messages cannot be rendered with this template (the template raised)."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str
    eos_token: str
    control: re.Pattern[str] = COMMON_CONTROL  # the control-token strings of this vocabulary

    @classmethod
    def from_llama(cls, llm: Llama) -> "ChatTemplate":
        """The template in the GGUF's `tokenizer.chat_template`, with its BOS/EOS strings."""
        source = llm.metadata.get("tokenizer.chat_template")
        if not source:
            raise TemplateError("the GGUF file has no tokenizer.chat_template")
        model = llm._model  # noqa: SLF001 - llama-cpp-python exposes token text only here
        bos, eos = llm.token_bos(), llm.token_eos()
        controls = [model.token_get_text(t) for t in range(llm.n_vocab())
                    if llama_cpp.llama_vocab_is_control(model.vocab, t)]
        return cls(
            source=source,
            bos_token=model.token_get_text(bos) if bos != -1 else "",
            eos_token=model.token_get_text(eos) if eos != -1 else "",
            control=control_pattern(controls),
        )

    def render_parts(self, messages: list[dict[str, Any]], continue_final: bool = False) -> list[tuple[str, bool]]:
        """The prompt as (text, is_content) parts in order: the template's own text, which may hold
        control tokens, and each message's content, which must be tokenized as plain text."""
        if continue_final and not messages[-1]["content"]:
            return self.render_parts(messages[:-1])
        nonce = secrets.token_hex(8)  # unguessable: content cannot forge a marker
        masked = [{**m, "content": f"\x00{nonce}:{i}\x00"} for i, m in enumerate(messages)]
        rendered = self.render(masked, continue_final)
        parts: list[tuple[str, bool]] = []
        position = 0
        for match in re.finditer(f"\x00{nonce}:(\\d+)\x00", rendered):
            parts += [(rendered[position:match.start()], False), (messages[int(match.group(1))]["content"], True)]
            position = match.end()
        parts.append((rendered[position:], False))
        return [(text, is_content) for text, is_content in parts if text]

    def render(self, messages: list[dict[str, Any]], continue_final: bool = False) -> str:
        """The prompt text the model's answer continues.

        Normally this ends with the generation prompt of a new assistant turn. With
        `continue_final`, the last message must be the assistant's and the prompt ends right after
        its content (as vLLM's `continue_final_message` does), so the answer continues it.
        """
        if continue_final and not messages[-1]["content"]:
            return self.render(messages[:-1])
        formatter = Jinja2ChatFormatter(
            template=self.source, eos_token=self.eos_token, bos_token=self.bos_token,
            add_generation_prompt=not continue_final,
        )
        try:
            prompt = formatter(messages=messages).prompt
        except Exception as exc:  # a template's raise_exception() or a Jinja error
            raise TemplateError(f"chat template failed: {exc}") from exc
        if not continue_final:
            return prompt
        final = messages[-1]["content"]
        cut = prompt.rfind(final)
        if cut < 0:
            raise TemplateError("cannot locate the final assistant message in the rendered template")
        return prompt[: cut + len(final)]
