"""Policy params from the command line: every param the console prints passes back through the CLI."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from console.cli import _register_commands, app
from console.commands.params import param_value, policy_params
from core.errors import PolicyError
from core.policies import registry

_register_commands(["policy"])
runner = CliRunner()
SPECS = registry.specs()


def test_values_json_none_and_text() -> None:
    assert param_value("{}", "--param x") == {}
    assert param_value('{"horizon": "lifetime", "w": [1, 2]}', "--param x") == {"horizon": "lifetime", "w": [1, 2]}
    assert param_value("[1, 2.5]", "--param x") == [1, 2.5]
    assert param_value("None", "--param x") is None and param_value("null", "--param x") is None
    assert param_value("{'a': None, 'b': True}", "--param x") == {"a": None, "b": True}  # how `status` prints
    assert param_value('"32"', "--param x") == "32"
    assert param_value("32", "--param x") == "32"  # text: the params model types it
    assert param_value("tokens", "--param x") == "tokens"
    with pytest.raises(PolicyError, match="--param x: '{oops' is neither JSON nor a Python literal"):
        param_value("{oops", "--param x")


def test_params_json_then_param_per_policy() -> None:
    assert policy_params(
        ["by=tokens", "sibyl.horizon=lifetime"], ['{"by": "requests", "bind": "arrival"}', 'sibyl={"unit": "x"}']
    ) == {"": {"by": "tokens", "bind": "arrival"}, "sibyl": {"unit": "x", "horizon": "lifetime"}}
    with pytest.raises(PolicyError, match="expected a JSON object, got list"):
        policy_params([], ["sibyl=[1]"])
    with pytest.raises(PolicyError, match="expected '\\{...\\}' or 'policy=\\{...\\}'"):
        policy_params([], ["sibyl"])
    with pytest.raises(PolicyError, match="expected key=value"):
        policy_params(["oops"])


def _as_printed(params: dict[str, Any]) -> dict[str, Any]:
    """The params as `status --json`, `policy list --json` and /control/state print them (JSON)."""
    out: dict[str, Any] = json.loads(json.dumps(params))
    return out


def _as_param_flags(name: str, params: dict[str, Any]) -> list[str]:
    """What a script writes from the printed params: one `--param name.key=value` each, a value
    as JSON unless it is text."""
    flags = []
    for key, value in params.items():
        text = value if isinstance(value, str) else json.dumps(value)
        flags += ["--param", f"{name}.{key}={text}"]
    return flags


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, dict[str, Any]]]:
    """What `policy set` sends to the control API (the HTTP call only is replaced)."""
    calls: list[tuple[str, str, dict[str, Any]]] = []

    class Recorder:
        def __init__(self, url: str | None, token: str | None) -> None:
            pass

        def set_policy(self, kind: str, name: str, params: dict[str, Any], pool: str | None = None) -> dict[str, Any]:
            calls.append((kind, name, params))
            return {"kind": kind, "old": "x", "new": name, "params": params, "source": "cli"}

    monkeypatch.setattr("console.control_client.ControlClient", Recorder)
    return calls


@pytest.mark.parametrize("spec", SPECS, ids=[f"{s.kind.value}-{s.name}" for s in SPECS])
def test_every_policys_printed_params_pass_back_through_policy_set(
    spec: registry.PolicySpec, sent: list[tuple[str, str, dict[str, Any]]]
) -> None:
    printed = _as_printed(spec.defaults())
    active = spec.params_model.model_validate(printed)  # what the console runs with those params
    for flags in (
        _as_param_flags(spec.name, printed),
        ["--params-json", json.dumps(printed)],
        ["--params-json", f"{spec.name}={json.dumps(printed)}"],
    ):
        sent.clear()
        result = runner.invoke(app, ["policy", "set", spec.kind.value, spec.name, *flags])
        assert result.exit_code == 0, (flags, result.output)
        [(kind, name, params)] = sent
        assert (kind, name) == (spec.kind.value, spec.name)
        assert spec.params_model.model_validate(params) == active == spec.params_model(), flags


def test_prefix_aware_decode_params_and_none_pass_back(sent: list[tuple[str, str, dict[str, Any]]]) -> None:
    args = ["--param", "decode_params={}", "--param", "balance_s=2.0", "--param", "prefix_aware.decode=sibyl"]
    assert runner.invoke(app, ["policy", "set", "routing", "prefix_aware", *args]).exit_code == 0
    assert sent[-1][2] == {"decode_params": {}, "balance_s": "2.0", "decode": "sibyl"}
    args = ["--param", "max_prefill_backlog_s=5", "--param", "max_prefill_backlog_s=None", "--param", "ttl_s=30"]
    assert runner.invoke(app, ["policy", "set", "queue", "fcfs", *args]).exit_code == 0
    params = sent[-1][2]
    assert params == {"max_prefill_backlog_s": None, "ttl_s": "30"}
    validated = registry.spec("queue", "fcfs").params_model.model_validate(params)
    assert validated.max_prefill_backlog_s is None  # type: ignore[attr-defined]


def test_sim_takes_the_printed_params_of_every_kind() -> None:
    from console.commands.sim import _policy_list
    from core.types import PolicyKind

    routing = _as_printed(registry.spec("routing", "prefix_aware").defaults())
    queue = _as_printed(registry.spec("queue", "fcfs").defaults())
    kinds = {PolicyKind.QUEUE: "fcfs", PolicyKind.RESCHEDULE: "none", PolicyKind.SCALING: "static"}
    policies, others = _policy_list(
        ["prefix_aware"], _as_param_flags("fcfs", queue)[1::2], kinds, ["prefix_aware=" + json.dumps(routing)]
    )
    assert policies == [("prefix_aware", routing)] and routing["decode_params"] == {}
    assert others[PolicyKind.QUEUE] == ("fcfs", {k: v if v is None else str(v) for k, v in queue.items()})
