"""OpenAI's Responses API on top of chat completions: a request becomes a chat request (with the
stored conversation before it), runs on the same admission, routing and pass-through, and its
chat answer (or its chunks, when streamed) becomes a Response (or the Responses event sequence)."""
