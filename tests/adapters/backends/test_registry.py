"""The backend registry and declared capabilities: built-ins, a third-party package, clear refusals."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.backends import BackendSettings, Capability, VllmSettings, registry
from adapters.backends.settings import EmulatorSettings
from adapters.errors import CapabilityError
from core.errors import ConfigError
from core.types import Role
from tests.procs import ROOT

PLUGIN = """
from typing import ClassVar
from adapters.backends import BackendBase, Capability
from adapters.vllm.instances import Instance

class ToyBackend(BackendBase):
    name: ClassVar[str] = "toy"
    summary: ClassVar[str] = "a third-party backend found through its entry point"
    capabilities = frozenset({Capability.SCALE})

    async def start(self) -> list[Instance]:
        return []

    async def stop(self) -> None:
        pass
"""


def test_built_in_backends_are_listed_with_what_they_declare() -> None:
    found = {b.name: b for b in registry.specs()}
    assert {"emulator", "sim", "vllm"} <= set(found)
    assert found["emulator"].capabilities >= {Capability.SCALE, Capability.ROLE_FLIP}
    assert Capability.MIGRATION not in found["vllm"].capabilities  # real vLLM cannot move a running request
    with pytest.raises(ConfigError, match="unknown backend 'nope'; installed: .*emulator"):
        registry.create("nope", BackendSettings(), Path("/tmp"))


def test_vllm_capabilities_follow_its_settings(tmp_path: Path) -> None:
    def caps(**vllm: object) -> frozenset[Capability]:
        return registry.create("vllm", BackendSettings(vllm=VllmSettings(**vllm)), tmp_path).capabilities  # type: ignore[arg-type]

    assert caps() == {Capability.SCALE}
    assert caps(kv_role="kv_both") == {Capability.SCALE, Capability.ROLE_FLIP}  # a flip is a routing change
    assert caps(scheduling_policy="priority") == {Capability.SCALE, Capability.PRIORITY}
    emulator = registry.create(
        "emulator", BackendSettings(emulator=EmulatorSettings(scheduling_policy="fcfs")), tmp_path
    )
    assert Capability.PRIORITY not in emulator.capabilities


def test_attached_instances_refuse_what_they_cannot_do(tmp_path: Path) -> None:
    attached = registry.create(
        "vllm", BackendSettings(attach={"prefill": ["http://a:1"], "decode": ["http://b:2"]}), tmp_path
    )
    assert attached.label == "vllm-attached" and attached.capabilities == frozenset()
    with pytest.raises(
        CapabilityError, match=r"does not support adding and removing instances \(its capabilities: none"
    ):
        asyncio.run(attached.add(Role.DECODE, "d1"))
    both = registry.create("emulator", BackendSettings(attach={"both": ["http://a:1", "http://b:2"]}), tmp_path)
    assert both.capabilities == {Capability.ROLE_FLIP}  # instances serving both legs flip by routing alone


@pytest.mark.slow  # ~5-15 s: the default suite stays under 6 min on 2 cores; make test-slow runs it
def test_a_third_party_backend_is_a_package_not_an_edit(tmp_path: Path) -> None:
    """A package with an entry point in `sibyl_console.backends` shows up in `doctor` and `up`."""
    site = tmp_path / "site"
    (site / "toy_backend").mkdir(parents=True)
    (site / "toy_backend" / "__init__.py").write_text(PLUGIN)
    dist = site / "toy_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[sibyl_console.backends]\ntoy = toy_backend:ToyBackend\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    out = subprocess.run(
        [sys.executable, "-m", "console.cli", "doctor", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    toy = next(b for b in json.loads(out.stdout)["backends"] if b["name"] == "toy")
    assert toy == {
        "name": "toy",
        "target": "toy_backend:ToyBackend",
        "summary": "a third-party backend found through its entry point",
        "capabilities": ["scale"],
        "error": None,
    }
    cfg = subprocess.run(
        [
            sys.executable,
            "-c",
            "from console.live.config import ConsoleConfig; print(ConsoleConfig(backend='toy').backend)",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cfg.stdout.strip() == "toy", cfg.stderr
