"""The ray backend end to end: `sibyl-console up --backend ray` on a local two-node Ray cluster (logical resources).

One `ray.cluster_utils.Cluster` for the module: a head offering `prefill_slot`s and a worker node
offering `decode_slot`s, so prefill actors land on the head and decode actors on the worker. One
console serves an emulated 2P4D cluster through it; the tests then scale out, drain, kill an
actor, and stop, checking the actors and their engine processes each time.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from adapters.backends import registry
from adapters.backends.base import Capability
from adapters.backends.settings import BackendSettings, RaySettings
from adapters.errors import BackendError
from core.errors import ConfigError
from core.types import Role
from tests.procs import Console, alive, decode_counts, kill_children, start_console, wait_for

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")

NAMESPACE = "sibyl-console"
CONFIG = """\
prefill = 2
decode = 4
profile = "cpu-tiny-llama"
policy = "round_robin"

[ray]
resources = {prefill = {prefill_slot = 1}, decode = {decode_slot = 1}}
"""
"""2P4D; round robin so a new decode instance surely gets traffic; prefill on the head, decode on the worker."""


class RayCluster:
    """The module's Ray cluster and the ids of its two nodes."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        fast_node_checks = {
            "health_check_period_ms": 1000,
            "health_check_failure_threshold": 3,
        }  # a dead node is declared in ~3 s, not ~15
        head = {
            "num_cpus": 1,
            "include_dashboard": False,
            "resources": {"prefill_slot": 2},
            "_system_config": fast_node_checks,
        }
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        try:
            self.worker = self.cluster.add_node(num_cpus=1, resources={"decode_slot": 8})
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING")
        except BaseException:
            self.cluster.shutdown()
            raise
        assert self.cluster.head_node is not None
        self.head_id: str = self.cluster.head_node.node_id
        self.worker_id: str = self.worker.node_id

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    c = RayCluster()
    try:
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def console(cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    tmp = tmp_path_factory.mktemp("ray-console")
    cfg = tmp / "cluster.toml"
    cfg.write_text(CONFIG)
    c = start_console(tmp, str(cfg), "--backend", "ray", "--ray-address", cluster.address, timeout=150)
    try:
        yield c
    finally:
        c.stop()
        kill_children(c.home)


def actor(console: Console, iid: str) -> Any:
    return ray.get_actor(f"{console.run_id}-{iid}", namespace=NAMESPACE)


def actor_gone(console: Console, iid: str) -> bool:
    try:
        actor(console, iid)
    except ValueError:
        return True
    return False


def engine_pid(console: Console, iid: str) -> int:
    return int(ray.get(actor(console, iid).where.remote(), timeout=10).pid)


def instance(console: Console, iid: str) -> dict[str, Any] | None:
    return next((i for i in console.state()["instances"] if i["id"] == iid), None)


def events(console: Console) -> list[dict[str, Any]]:
    """The console's recent events (the history /control/events replays before its first state)."""
    out: list[dict[str, Any]] = []
    with console.control() as c, c.stream("GET", "/control/events") as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev["type"] == "state":
                break
            out.append(ev)
    return out


def complete(console: Console, n: int) -> list[str]:
    """`n` completions through the gateway; returns their texts (any failure raises)."""
    client = OpenAI(base_url=console.url + "/v1", api_key="x", max_retries=0)
    return [
        client.completions.create(model="sibyl-model", prompt=f"ray {k}", max_tokens=4, extra_body={"ignore_eos": True})
        .choices[0]
        .text
        for k in range(n)
    ]


def test_2p4d_through_ray_serves_openai_traffic_and_shows_nodes(console: Console, cluster: RayCluster) -> None:
    s = console.state()
    assert s["backend"] == "ray-emulator" and s["cluster"] == "2P4D"
    assert all(i["healthy"] for i in s["instances"]) and len(s["instances"]) == 6
    nodes = {i["id"]: i["node"] for i in s["instances"]}
    # placed by Ray by the resources each role asks for: prefill on the head, decode on the worker
    assert all(nodes[p].endswith(cluster.head_id[:8]) for p in ("p0", "p1")), nodes
    assert all(nodes[d].endswith(cluster.worker_id[:8]) for d in ("d0", "d1", "d2", "d3")), nodes
    assert set(s["capabilities"]) >= {"scale", "role_flip", "migration", "priority"}
    client = OpenAI(base_url=console.url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(
        model="sibyl-model", prompt="hello " * 20, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == "".join(f" t{i}" for i in range(6))
    chunks = client.chat.completions.create(
        model="sibyl-model",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == " t0 t1 t2"
    assert console.state()["requests"]["failed"] == 0
    for iid in nodes:  # each instance is a named actor of this run, running its engine
        assert alive(engine_pid(console, iid))


def test_scale_out_places_a_new_actor_that_gets_traffic(console: Console, cluster: RayCluster) -> None:
    with console.control() as c:
        r = c.post("/control/scale", json={"role": "decode", "delta": 1})
    assert r.status_code == 200 and r.json()["instances"] == ["d4"], r.text
    wait_for(
        lambda: (i := instance(console, "d4")) is not None and i["phase"] == "active" and i["healthy"],
        60,
        "d4 to be active",
    )
    assert instance(console, "d4")["node"].endswith(cluster.worker_id[:8])  # type: ignore[index]
    assert console.state()["cluster"] == "2P5D"
    complete(console, 10)  # round robin over five decode instances
    assert decode_counts(console).get("d4", 0) >= 1
    assert any(e.get("instance") == "d4" and e.get("event") == "added" for e in events(console))


def test_drain_stops_the_engine_and_the_actor(console: Console) -> None:
    pid = engine_pid(console, "d4")
    url = instance(console, "d4")["url"]  # type: ignore[index]
    with console.control() as c:
        r = c.post("/control/scale", json={"role": "decode", "delta": -1})
    assert r.status_code == 200 and r.json()["instances"] == ["d4"], r.text
    wait_for(lambda: instance(console, "d4") is None, 30, "d4 to be removed")
    wait_for(lambda: actor_gone(console, "d4"), 15, "d4's actor to go")
    wait_for(lambda: not alive(pid), 15, "d4's engine process to stop")
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)
    assert any(e.get("instance") == "d4" and e.get("event") == "removed" for e in events(console))
    assert console.state()["cluster"] == "2P4D"
    complete(console, 4)


def test_a_killed_actor_is_marked_down_with_its_reason_and_routing_moves_on(console: Console) -> None:
    pid = engine_pid(console, "d1")
    ray.kill(actor(console, "d1"), no_restart=True)
    wait_for(lambda: not instance(console, "d1")["healthy"], 20, "d1 to be marked down")  # type: ignore[index]
    wait_for(lambda: not alive(pid), 15, "d1's engine to stop with its actor")

    def reason_recorded() -> bool:
        return any(
            e.get("instance") == "d1" and e.get("event") in ("down", "lost") and "ray.kill" in str(e.get("detail"))
            for e in events(console)
        )

    wait_for(reason_recorded, 15, "the Ray reason of d1's loss to be recorded")
    failed, on_d1 = console.state()["requests"]["failed"], decode_counts(console).get("d1", 0)
    assert complete(console, 8) == [" t0 t1 t2 t3"] * 8  # the other decode instances take the traffic
    assert console.state()["requests"]["failed"] == failed and decode_counts(console).get("d1", 0) == on_d1
    assert not instance(console, "d1")["healthy"]  # type: ignore[index]


def test_stopping_the_console_stops_every_actor_and_engine(console: Console) -> None:
    ids = [i["id"] for i in console.state()["instances"] if i["healthy"]]
    pids = [engine_pid(console, iid) for iid in ids]
    assert console.stop() == 0
    assert "run completed" in console.log.read_text()
    wait_for(lambda: all(actor_gone(console, iid) for iid in ids), 15, "the run's actors to go")
    wait_for(lambda: not any(alive(p) for p in pids), 15, "the engines to stop")
    assert len(ray.nodes()) == 2 and all(n["Alive"] for n in ray.nodes())  # a cluster it joined keeps running


def test_without_an_address_a_local_ray_starts_and_stops_with_the_console(cluster: RayCluster, tmp_path: Path) -> None:
    con = start_console(
        tmp_path, "--backend", "ray", "--prefill", "1", "--decode", "1", "--profile", "cpu-tiny-llama", timeout=120
    )
    try:
        s = con.state()
        assert s["cluster"] == "1P1D" and all(i["healthy"] and i["node"] for i in s["instances"])
        assert all(
            i["url"].startswith("http://127.0.0.1:") for i in s["instances"]
        )  # engines of a local Ray stay on loopback
        assert not {i["node"].split()[-1] for i in s["instances"]} & {cluster.head_id[:8], cluster.worker_id[:8]}
        assert complete(con, 2) == [" t0 t1 t2 t3"] * 2
    finally:
        assert con.stop() == 0
        kill_children(con.home)
    assert "run completed" in con.log.read_text()
    assert len(ray.nodes()) == 2  # the module's cluster was not touched


def test_a_lost_node_is_reported_with_its_reason(cluster: RayCluster, tmp_path: Path) -> None:
    """The backend alone, in this process (it reuses the test's Ray connection): a node that dies
    without warning takes its instance with it, and the backend says which node went."""
    from adapters.ray.backend import RayBackend

    node = cluster.cluster.add_node(num_cpus=0, resources={"doomed_slot": 1})
    cluster.cluster.wait_for_nodes()
    settings = BackendSettings(
        prefill=0, decode=1, profile="cpu-tiny-llama", ray=RaySettings(resources={"decode": {"doomed_slot": 1}})
    )
    backend = RayBackend(settings, tmp_path / "r-lost-node")

    async def scenario() -> tuple[list[Any], list[tuple[str, str]], float]:
        lost: list[tuple[str, str]] = []
        (inst,) = await backend.start()
        try:
            backend.on_lost(lambda iid, why: lost.append((iid, why)))
            assert inst.node is not None and inst.node.endswith(node.node_id[:8])
            assert httpx.get(inst.url + "/health", timeout=5).status_code == 200
            t0 = time.monotonic()
            cluster.cluster.remove_node(node, allow_graceful=False)  # like a machine dying
            while not lost and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.1)
            return [inst], lost, time.monotonic() - t0
        finally:
            await backend.stop()

    _, lost, after_s = asyncio.run(scenario())
    assert len(lost) == 1 and lost[0][0] == "d0", lost
    assert (
        f"its Ray node {node.node_ip_address} {node.node_id[:8]} is gone" == lost[0][1] or "node" in lost[0][1].lower()
    ), lost
    assert after_s < 30 and backend.members == {}
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2


def test_an_engine_that_cannot_start_fails_clearly_and_leaves_nothing(cluster: RayCluster, tmp_path: Path) -> None:
    from adapters.ray.actor import InstanceActor
    from adapters.ray.backend import RayBackend

    settings = BackendSettings(
        prefill=1,
        decode=1,
        profile="cpu-tiny-llama",
        emulator={"extra_args": ["--no-such-flag"]},
        ray=RaySettings(resources={"decode": {"decode_slot": 1}}),
    )
    backend = RayBackend(settings, tmp_path / "r-broken")
    with pytest.raises(
        BackendError, match=r"did not start: EmulatorStartError: emulator (prefill|decode) on port \d+ exited with"
    ):
        asyncio.run(backend.start())
    assert backend.members == {}
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert not {"r-broken-p0", "r-broken-d0"} & names
    assert InstanceActor().ping() == "its engine was stopped"


# --- settings, capabilities and errors (no console) ----------------------------------------------------
def test_ray_settings_are_validated_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown role"):
        RaySettings(resources={"decoder": {"slot": 1}})
    with pytest.raises(ValueError, match="num_cpus"):
        RaySettings(resources={"decode": {"CPU": 1}})
    with pytest.raises(ValueError, match="positive"):
        RaySettings(resources={"decode": {"decode_slot": 0}})
    with pytest.raises(ValueError, match="leave the address unset"):
        RaySettings(address="local")
    with pytest.raises(ValueError, match="engine"):
        RaySettings.model_validate({"engine": "sglang"})
    assert RaySettings(resources={"decode": {"decode_slot": 1}}).resources_for(Role.PREFILL) == {}


def test_capabilities_follow_the_engine(tmp_path: Path) -> None:
    from adapters.ray import cluster as rc
    from adapters.ray.backend import RayBackend

    emu = registry.create("ray", BackendSettings(), tmp_path)
    assert isinstance(emu, RayBackend) and emu.label == "ray-emulator"
    assert emu.capabilities == {Capability.SCALE, Capability.ROLE_FLIP, Capability.MIGRATION, Capability.PRIORITY}
    vllm = BackendSettings(model="m", ray=RaySettings(engine="vllm", tensor_parallel_size=2))
    backend = RayBackend(vllm, tmp_path)
    assert backend.capabilities == {Capability.SCALE}  # real vLLM cannot migrate; flips only with kv_both
    assert rc.request(vllm, Role.DECODE) == {"GPU": 2.0}
    assert rc.request(
        BackendSettings(ray=RaySettings(num_cpus=0.5, resources={"decode": {"decode_slot": 1}})), Role.DECODE
    ) == {"CPU": 0.5, "decode_slot": 1}
    assert (
        rc.request(vllm.model_copy(update={"vllm": vllm.vllm.model_copy(update={"device": "cpu"})}), Role.DECODE) == {}
    )


def test_a_role_no_node_can_hold_is_refused_at_once(cluster: RayCluster) -> None:
    from adapters.ray import cluster as rc

    with pytest.raises(ConfigError, match="no Ray node offers.*decode_slot.*prefill_slot"):
        rc.check_placeable(BackendSettings(ray=RaySettings(resources={"decode": {"decode_slot": 99}})), [Role.DECODE])
    rc.check_placeable(BackendSettings(ray=RaySettings(resources={"decode": {"decode_slot": 1}})), [Role.DECODE])


def test_without_ray_installed_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from adapters.ray import cluster as rc

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    with pytest.raises(BackendError, match=r"pip install 'sibyl-console\[ray\]'"):
        rc.import_ray()


def test_an_address_where_no_ray_listens_fails_fast_and_clearly(tmp_path: Path) -> None:
    from adapters.ports import free_port

    con = Console("", tmp_path, tmp_path / "runs.db", None, tmp_path / "log")  # type: ignore[arg-type]
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = con.cli("up", "--headless", "--port", "0", "--backend", "ray", "--ray-address", address)
    assert r.returncode == 2 and f"no Ray cluster answers at {address}" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30  # ray.init alone would retry for minutes


def test_ray_flags_need_the_ray_backend_and_ray_is_listed(tmp_path: Path) -> None:
    con = Console("", tmp_path, tmp_path / "runs.db", None, tmp_path / "log")  # type: ignore[arg-type]
    r = con.cli("up", "--headless", "--engine", "vllm")
    assert r.returncode == 2 and "apply to --backend ray only" in r.stderr
    listed = {b.name: b for b in registry.specs()}  # what `doctor` lists
    assert listed["ray"].target == "adapters.ray.backend:RayBackend" and listed["ray"].error is None
    assert "pip install 'sibyl-console[ray]'" in " ".join(con.cli("up", "--help").stdout.split())
