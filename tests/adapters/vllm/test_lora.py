"""The console's calls to vLLM's LoRA endpoints against vLLM 0.32's answers (httpx.MockTransport): the bodies sent,
the success text, and each failure turned into one error naming the instance, the adapter and vLLM's message."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import orjson
import pytest

from adapters.vllm.lora import AdapterCallError, LoraEndpoints, check_adapter_dir, vllm_message

URL = "http://127.0.0.1:8100"


def vllm_error(status: int, message: str, type_: str = "BadRequestError") -> httpx.Response:
    """vLLM 0.32's ErrorResponse body."""
    body = {"error": {"message": message, "type": type_, "param": None, "code": status}}
    return httpx.Response(status, content=orjson.dumps(body), headers={"content-type": "application/json"})


def endpoints(handler: httpx.MockTransport) -> LoraEndpoints:
    return LoraEndpoints(httpx.AsyncClient(transport=handler))


def test_a_load_posts_vllms_body_and_returns_its_text() -> None:
    seen: list[tuple[str, dict[str, object]]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, text="Success: LoRA adapter 'sql' added successfully.")

    lora = endpoints(httpx.MockTransport(answer))
    text = asyncio.run(lora.load("p0", URL + "/", "sql", "/adapters/sql"))
    assert text == "Success: LoRA adapter 'sql' added successfully."
    assert seen == [("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/adapters/sql"})]
    asyncio.run(lora.load("p0", URL, "sql", "/adapters/sql", inplace=True))
    assert seen[-1][1] == {"lora_name": "sql", "lora_path": "/adapters/sql", "load_inplace": True}
    asyncio.run(lora.unload("p0", URL, "sql"))
    assert seen[-1] == ("/v1/unload_lora_adapter", {"lora_name": "sql"})


@pytest.mark.parametrize(
    ("answer", "status", "says"),
    [
        (
            vllm_error(404, "Loading lora sql failed: No adapter found for /nope", "NotFoundError"),
            404,
            "No adapter found",
        ),
        (
            vllm_error(400, "LoRA rank 64 is greater than max_lora_rank 16."),
            400,
            "LoRA rank 64 is greater than max_lora_rank 16.",
        ),
        (
            vllm_error(400, "The lora adapter 'sql' has already been loaded.", "InvalidUserInput"),
            400,
            "has already been loaded",
        ),
        # without VLLM_ALLOW_RUNTIME_LORA_UPDATING the routes do not exist: FastAPI's own 404
        (httpx.Response(404, json={"detail": "Not Found"}), 404, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"),
        (httpx.Response(500, text="Internal Server Error"), 500, "Internal Server Error"),
    ],
)
def test_a_refused_load_names_the_instance_the_adapter_and_vllms_message(
    answer: httpx.Response, status: int, says: str
) -> None:
    lora = endpoints(httpx.MockTransport(lambda _: answer))
    with pytest.raises(AdapterCallError) as caught:
        asyncio.run(lora.load("d3", URL, "sql", "/nope"))
    e = caught.value
    assert (e.instance_id, e.adapter, e.action, e.status) == ("d3", "sql", "load", status)
    assert says in e.message and str(e).startswith(f"load of LoRA adapter 'sql' on d3 failed: vLLM answered {status}: ")


def test_an_unreachable_instance_is_named_too() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(AdapterCallError, match=r"unload of LoRA adapter 'sql' on p1 failed: ConnectError") as caught:
        asyncio.run(endpoints(httpx.MockTransport(refuse)).unload("p1", URL, "sql"))
    assert caught.value.status is None


def test_vllm_messages_in_each_shape() -> None:
    assert vllm_message(400, b'{"message": "old shape", "type": "x", "code": 400}') == "old shape"
    assert vllm_message(422, b'{"detail": [{"msg": "Field required"}]}') == '[{"msg":"Field required"}]'
    assert vllm_message(502, b"") == "HTTP 502"


def test_an_adapter_directory_needs_its_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        check_adapter_dir(tmp_path / "missing")
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        check_adapter_dir(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{}")
    assert check_adapter_dir(tmp_path) == tmp_path.absolute()
