"""``ds4lab serve``: ds4-server's HTTP surface on a ds4lab model. OpenAI's ``/v1/chat/completions`` and
``/v1/completions``, Anthropic's ``/v1/messages``, streamed or not; one live session reused across requests by
``sync``; requests one at a time through a bounded queue; the disk KV cache on ds4-server's schedule.

:mod:`.protocol` reads and checks requests, :mod:`.channels` splits and cuts the generated text, :mod:`.worker`
runs requests on the model, :mod:`.app` is the Starlette app, :mod:`.running` runs it with uvicorn. Needs the
``server`` extra (Starlette, uvicorn)."""

from ..platform_support import require_processes

require_processes("ds4lab serve (ds4lab.server)")  # before uvicorn's import fails less clearly

from .running import ServerThread, build, serve  # noqa: E402

__all__ = ["ServerThread", "build", "serve"]
