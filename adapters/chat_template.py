"""Render chat messages with a model's own Jinja chat template (from its GGUF metadata)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter


class TemplateError(ValueError):
    """The messages cannot be rendered with this template (the template raised)."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str
    eos_token: str

    @classmethod
    def from_llama(cls, llm: Llama) -> "ChatTemplate":
        """The template in the GGUF's `tokenizer.chat_template`, with its BOS/EOS strings."""
        source = llm.metadata.get("tokenizer.chat_template")
        if not source:
            raise TemplateError("the GGUF file has no tokenizer.chat_template")
        model = llm._model  # noqa: SLF001 - llama-cpp-python exposes token text only here
        bos, eos = llm.token_bos(), llm.token_eos()
        return cls(
            source=source,
            bos_token=model.token_get_text(bos) if bos != -1 else "",
            eos_token=model.token_get_text(eos) if eos != -1 else "",
        )

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
