"""The console's calls to vLLM's runtime LoRA endpoints (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`), its
failures turned into one error naming the instance, the adapter and vLLM's own message.

vLLM 0.32 (`entrypoints/serve/lora/`) attaches these routes only when the server runs with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=true` (otherwise FastAPI's 404 `{"detail": "Not Found"}`) and
`--enable-lora`. A load answers 200 with a text line; a failure answers vLLM's error body
`{"error": {"message", "type", "param", "code"}}` (400 for an empty field, a name already loaded or a
rank above `--max-lora-rank`, 404 when the path holds no adapter); an unload of an unknown name is 404.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson

from adapters.errors import AdapterError

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
ADAPTER_CONFIG = "adapter_config.json"
"""The file every PEFT adapter directory holds (vLLM reads its rank and target modules from it)."""


class AdapterCallError(AdapterError):
    """A load or unload of a LoRA adapter on one instance failed; says where and what vLLM answered."""

    def __init__(self, instance_id: str, action: str, adapter: str, status: int | None, message: str) -> None:
        self.instance_id, self.action, self.adapter, self.status, self.message = (
            instance_id,
            action,
            adapter,
            status,
            message,
        )
        answered = f"vLLM answered {status}: {message}" if status is not None else message
        super().__init__(f"{action} of LoRA adapter {adapter!r} on {instance_id} failed: {answered}")


def check_adapter_dir(path: str | Path) -> Path:
    """The adapter directory, absolute; ValueError naming what is missing when it holds no adapter."""
    folder = Path(path).expanduser().absolute()
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a directory (a LoRA adapter is a directory holding {ADAPTER_CONFIG})")
    if not (folder / ADAPTER_CONFIG).is_file():
        raise ValueError(f"{folder} has no {ADAPTER_CONFIG}: not a PEFT LoRA adapter")
    return folder


def vllm_message(status: int, raw: bytes) -> str:
    """vLLM's message in an error answer: its `{"error": {"message"}}` (or the older top-level
    `message`), FastAPI's `detail`, else the text itself (trimmed)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(body.get("message"), str):
            return str(body["message"])
        detail = body.get("detail")
        if detail is not None:
            text = detail if isinstance(detail, str) else orjson.dumps(detail).decode()
            if status == 404 and text == "Not Found":
                return (
                    "Not Found (no runtime LoRA endpoints: start the instance with --enable-lora and "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)"
                )
            return text
    text = raw.decode(errors="replace").strip()
    return text[:500] or f"HTTP {status}"


class LoraEndpoints:
    """Loads and unloads adapters on instances by URL through one pooled HTTP client."""

    def __init__(self, client: httpx.AsyncClient | None = None, timeout_s: float = 120.0) -> None:
        self._own = client is None
        self.http = client or httpx.AsyncClient(timeout=timeout_s)

    async def load(self, instance_id: str, url: str, name: str, path: str, *, inplace: bool = False) -> str:
        """Register and load adapter `name` from `path` on the instance at `url`; vLLM's success text."""
        body: dict[str, object] = {"lora_name": name, "lora_path": path}
        if inplace:
            body["load_inplace"] = True
        return await self._post(instance_id, "load", name, url.rstrip("/") + LOAD_PATH, body)

    async def unload(self, instance_id: str, url: str, name: str) -> str:
        """Unload adapter `name` from the instance at `url`; vLLM's success text."""
        return await self._post(instance_id, "unload", name, url.rstrip("/") + UNLOAD_PATH, {"lora_name": name})

    async def _post(self, instance_id: str, action: str, name: str, url: str, body: dict[str, object]) -> str:
        try:
            r = await self.http.post(url, content=orjson.dumps(body), headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            raise AdapterCallError(instance_id, action, name, None, f"{type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise AdapterCallError(instance_id, action, name, r.status_code, vllm_message(r.status_code, r.content))
        return r.text.strip()

    async def close(self) -> None:
        if self._own:
            await self.http.aclose()
