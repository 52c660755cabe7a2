"""The Responses streaming event sequence, translated from chat.completion.chunk bodies.

response.created, response.in_progress; per output item: response.output_item.added, then for a
message response.content_part.added, response.output_text.delta (each with the gateway's
`routing` provenance when the token-level path wrote it), response.output_text.done,
response.content_part.done, and for a function call response.function_call_arguments.delta and
.done; response.output_item.done; finally response.completed (or response.incomplete) carrying
the whole Response with usage and `usage.routing`.
"""

from __future__ import annotations

from typing import Any

from gateway.responses.output import (
    INCOMPLETE,
    ResponseDraft,
    call_item,
    logprobs_of,
    message_item,
    text_part,
    usage_of,
)


class ResponseEvents:
    """Feed it a chat answer's chunks in order; it returns the Responses events each one makes."""

    def __init__(self, draft: ResponseDraft) -> None:
        self.draft = draft
        self.items: list[dict[str, Any]] = []  # the output so far
        self.final: dict[str, Any] | None = None  # the Response, once finished
        self._sequence = 0
        self._message: int | None = None  # output index of the open message item
        self._text: list[str] = []
        self._logprobs: list[dict[str, Any]] = []
        self._calls: dict[int, int] = {}  # chat tool-call index -> output index of its open item
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None

    def start(self) -> list[dict[str, Any]]:
        response = self.draft.render([], "in_progress", None)
        return [self._event("response.created", response=response), self._event("response.in_progress",
                                                                                 response=response)]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if chunk.get("usage"):
            self._usage = usage_of(chunk["usage"])
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text = (delta.get("content") or "") + (delta.get("refusal") or "")
            if text:
                events += self._text_delta(text, logprobs_of(choice.get("logprobs")), chunk.get("routing"))
            for call in delta.get("tool_calls") or ():
                events += self._call_delta(call)
            self._finish_reason = choice.get("finish_reason") or self._finish_reason
        return events

    def finish(self) -> list[dict[str, Any]]:
        """Close the open items and render the final Response (also kept as `final`)."""
        if not self.items:
            events = self._open_message()
        else:
            events = []
        events += self._close_message() + self._close_calls()
        self.final = self.draft.render(self.items, "completed", self._usage, self._finish_reason)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=self.final)]

    def error(self, body: dict[str, Any]) -> dict[str, Any]:
        """The `error` event of an OpenAI error body ({"error": {...}})."""
        error = body["error"]
        return self._event("error", code=error.get("code"), message=error["message"], param=error.get("param"))

    def _text_delta(self, text: str, logprobs: list[dict[str, Any]], routing: dict[str, Any] | None) -> list[dict]:
        events = self._open_message() if self._message is None else []
        self._text.append(text)
        self._logprobs += logprobs
        event = self._event("response.output_text.delta", item_id=self.items[self._message]["id"],
                            output_index=self._message, content_index=0, delta=text, logprobs=logprobs)
        if routing is not None:
            event["routing"] = routing
        return events + [event]

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index = call.get("index", 0)
        events: list[dict[str, Any]] = []
        if index not in self._calls:
            events += self._close_message()
            item = call_item({"id": call.get("id"), "function": {"name": (call.get("function") or {}).get("name")}},
                             "in_progress")
            self._calls[index] = len(self.items)
            self.items.append(item)
            events.append(self._event("response.output_item.added", output_index=self._calls[index], item=dict(item)))
        item = self.items[self._calls[index]]
        arguments = (call.get("function") or {}).get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._calls[index], delta=arguments))
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        self._message = len(self.items)
        item = message_item("", "in_progress")
        item["content"] = []
        self.items.append(item)
        return [self._event("response.output_item.added", output_index=self._message, item=dict(item, content=[])),
                self._event("response.content_part.added", item_id=item["id"], output_index=self._message,
                            content_index=0, part=text_part(""))]

    def _close_message(self) -> list[dict[str, Any]]:
        if self._message is None:
            return []
        index, self._message = self._message, None
        item = self.items[index]
        text, part = "".join(self._text), text_part("".join(self._text), self._logprobs)
        item.update(status=self._status(), content=[part])
        common = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [self._event("response.output_text.done", **common, text=text, logprobs=self._logprobs),
                self._event("response.content_part.done", **common, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _close_calls(self) -> list[dict[str, Any]]:
        events = []
        for index in self._calls.values():
            item = self.items[index]
            item["status"] = "completed"
            events += [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]),
                       self._event("response.output_item.done", output_index=index, item=item)]
        self._calls = {}
        return events

    def _status(self) -> str:
        return "incomplete" if self._finish_reason in INCOMPLETE else "completed"

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}
