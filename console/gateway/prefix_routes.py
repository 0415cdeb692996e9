"""The prefix index's control route: where a prompt's blocks are cached, as routing sees it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from console.error_bodies import error_body

if TYPE_CHECKING:
    from console.live.controller import Controller


def prefix_routes(c: Controller, guard: Any) -> list[Route]:
    """POST /control/prefix/match: a completions or chat body (token ids, text or messages) in; its
    block count in the engines' block size, and per instance holding its first block how many
    leading blocks the console's index says it holds (text and chat prompts tokenized as for routing)."""

    async def match(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:
            return Response(error_body(400, f"malformed JSON body: {e}"), 400, media_type="application/json")
        if not isinstance(body, dict) or not ("prompt" in body or "messages" in body):
            return Response(
                error_body(400, 'expected a completions or chat body: {"prompt": ...} or {"messages": [...]}'),
                400,
                media_type="application/json",
            )
        result = await c.prefix.lookup(body, c.instances.values())
        return Response(orjson.dumps(result), 200, media_type="application/json")

    return [Route("/control/prefix/match", guard(match), methods=["POST"])]
