"""Server-sent events: a job's events as a streamed response reads them, and one event's text."""

from __future__ import annotations

import asyncio
import json

from .worker import Job

KEEPALIVE_S = 1.0  # an SSE comment while the model is busy elsewhere: also how a gone client is noticed


async def events(job: Job):
    """The job's events, with None every KEEPALIVE_S while nothing happens; marks the job cancelled when the
    response stops being consumed (the client went away)."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield None
                continue
            yield event
            if event[0] in ("done", "error"):
                return
    finally:
        job.cancelled.set()


def sse(data: dict, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"
