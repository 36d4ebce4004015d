"""Server-sent events as the OpenAI API writes them: `data: {json}` blocks, then
`data: [DONE]`. An error mid-stream is a `data: {"error": {...}}` block (what the `openai`
client raises as an APIError), still followed by `[DONE]`."""

from __future__ import annotations

import json

DONE = "data: [DONE]\n\n"


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
