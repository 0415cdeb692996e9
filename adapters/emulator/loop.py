"""RunLoop: a scheduler whose `_run` coroutine runs as one task between start() and stop()."""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from typing import ClassVar


class RunLoop(ABC):
    """start() runs `_run` as a task; stop() cancels it and waits until it has ended."""

    task_name: ClassVar[str] = "run-loop"
    _task: asyncio.Task[None] | None = None

    @abstractmethod
    async def _run(self) -> None:
        """The scheduler's loop; runs until cancelled."""

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
