"""The Grafana dashboard (demos/grafana/sibyl-pd.json) reads only series that exist.

Every PromQL expression of the dashboard (panel targets, template variables, annotations) is
parsed for the series names it selects, and each one must be a sample name in a live scrape of a
real console's /metrics or of one of its emulated instances' /metrics, after a few streamed and
whole (non-streamed) requests and a policy swap. The README beside the dashboard documents each
panel and each series.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.procs import FAST_PROFILE, ROOT, Console, kill_children, start_console

DASHBOARD = ROOT / "demos" / "grafana" / "sibyl-pd.json"
README = ROOT / "demos" / "grafana" / "README.md"

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARS = re.compile(r"\$\{[^}]*\}|\$\w+")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_OFFSETS = re.compile(r"\boffset\s+-?(?:\d+(?:ms|[smhdwy]))+|@\s*(?:start\(\)|end\(\)|[\d.]+)")
_NUMBERS = re.compile(r"(?<![\w:.])(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?![\w:])")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def series_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects (as exposed: `x_bucket`, `x_total`, `vllm:x`).

    Label values (strings) go first, then Grafana variables, label matchers `{...}`, range and
    subquery selectors `[...]`, label lists of by/without/on/ignoring/group_left/group_right,
    offset and @ modifiers, and numbers; of the identifiers left, those followed by `(` are functions or aggregations,
    the rest are keywords or series names."""
    if expr.startswith("label_values("):  # a Grafana variable query: label_values(series, label)
        inner = expr[len("label_values(") :].rsplit(",", 1)[0]
        return series_names(inner)
    text = _STRINGS.sub('""', expr)
    text = _GRAFANA_VARS.sub("1", text)
    text = _MATCHERS.sub("", text)
    text = _RANGES.sub("", text)
    text = _LABEL_LISTS.sub("", text)
    text = _OFFSETS.sub("", text)
    text = _NUMBERS.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        rest = text[m.end() :].lstrip()
        if rest.startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def test_series_names_strips_functions_matchers_and_variables() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, slo_class) (rate(sibyl_ttft_seconds_bucket{job=~"$gateway", '
        'slo_class=~"$slo_class"}[$__rate_interval])))'
    )
    assert series_names(expr) == {"sibyl_ttft_seconds_bucket"}
    expr = (
        '1000 * (sibyl_policy_last_swap_timestamp_seconds{job=~"$gateway"} > 0) * on (job, instance, pool, kind) '
        'group_left (name) sibyl_policy_info{job=~"$gateway"}'
    )
    assert series_names(expr) == {"sibyl_policy_last_swap_timestamp_seconds", "sibyl_policy_info"}
    assert series_names('sum by (instance) (rate(vllm:prefix_cache_hits_total{x="a{b}"}[5m])) / 1e3') == {
        "vllm:prefix_cache_hits_total"
    }
    assert series_names("label_values(vllm:num_requests_running, job)") == {"vllm:num_requests_running"}
    assert series_names('increase(sibyl_policy_swaps_total{job=~"${gateway}"}[$__range] offset 1h5m) @ end()') == {
        "sibyl_policy_swaps_total"
    }
    assert series_names("sum(up) by (job) unless on (job) absent(vllm:x_count)") == {"up", "vllm:x_count"}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(d: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in d["panels"]:
        yield p
        yield from p.get("panels", [])


def expressions(d: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every query in the dashboard."""
    out = [(f"panel {p['title']!r}", t["expr"]) for p in panels(d) for t in p.get("targets", [])]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable {v['name']}", q))
    out += [(f"annotation {a['name']!r}", a["expr"]) for a in d["annotations"]["list"] if "expr" in a]
    return out


def sample_names(text: str) -> set[str]:
    """Every sample name of a Prometheus text page (`x_bucket`, `x_sum`, `x_count`, `x_total`, ...)."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def test_the_dashboard_is_well_formed_and_documented() -> None:
    d = dashboard()
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids))
    readme = README.read_text()
    for p in panels(d):
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert f"**{p['title']}**" in readme, f"panel {p['title']!r} is not documented in {README.name}"
    used = {n for _, e in expressions(d) for n in series_names(e)}
    assert used
    for name in used:
        base = re.sub(r"_(bucket|sum|count|total)$", "", name)
        assert base in readme, f"{name} is used by the dashboard but not documented in {README.name}"


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    tmp = tmp_path_factory.mktemp("grafana")
    c = start_console(tmp, "--profile", FAST_PROFILE, "--prefill", "1", "--decode", "1")
    try:
        yield c
    finally:
        c.stop()
        kill_children(c.home)


def test_every_series_the_dashboard_reads_is_in_a_live_scrape(console: Console) -> None:
    c = OpenAI(base_url=console.url + "/v1", api_key="x", max_retries=0)
    for i in range(3):
        c.completions.create(model="sibyl-model", prompt=f"whole {i}", max_tokens=6, extra_body={"ignore_eos": True})
        stream = c.completions.create(
            model="sibyl-model", prompt=f"streamed {i}", max_tokens=6, stream=True, extra_body={"ignore_eos": True}
        )
        assert "".join(ch.choices[0].text for ch in stream if ch.choices)
    with console.control() as ctl:
        assert ctl.put("/control/policies/routing", json={"name": "least_load"}).status_code == 200
    state = console.state()
    gateway = httpx.get(console.url + "/metrics").text
    instances = [httpx.get(i["url"] + "/metrics").text for i in state["instances"]]
    present = sample_names(gateway).union(*map(sample_names, instances))
    missing = sorted(
        f"{where}: {name}"
        for where, expr in expressions(dashboard())
        for name in series_names(expr)
        if name not in present
    )
    assert not missing, "the dashboard reads series nobody exports:\n" + "\n".join(missing)

    # the swap annotation has what it joins: a swap time and the active policy's name
    # (one pool, named after its served model: the `pool` label both sides of the annotation's join carry)
    swapped_at = r'^sibyl_policy_last_swap_timestamp_seconds\{kind="routing",pool="sibyl-model"\} [1-9]'
    assert re.search(swapped_at, gateway, re.M)
    active = r'^sibyl_policy_info\{kind="routing",name="least_load",.*,pool="sibyl-model"\} 1\.0$'
    assert re.search(active, gateway, re.M)
    # whole replies have no TPOT: three streamed requests were observed, the three whole ones were not
    assert re.search(r'^sibyl_tpot_seconds_count\{slo_class="default"\} 3\.0$', gateway, re.M)
    assert re.search(r'^sibyl_ttft_seconds_count\{slo_class="default"\} 6\.0$', gateway, re.M)
    assert re.search(r'^sibyl_whole_replies_total\{slo_class="default"\} 3\.0$', gateway, re.M)
    assert re.search(
        r'^sibyl_decisions_total\{(?=[^}]*kind="routing")(?=[^}]*outcome="routed")[^}]*\} 6\.0$', gateway, re.M
    )
    run = state["slo"]["run"]
    assert run["requests"] == 6 and run["tpot_unknown"] == 3


def test_whole_replies_are_stored_without_a_tpot(console: Console) -> None:
    """The run store after the console stopped: a whole reply's TPOT and first token are NULL, its
    TTFT is its prefill leg's end; `runs show` says so and prints "-" for what was not measured."""
    c = OpenAI(base_url=console.url + "/v1", api_key="x", max_retries=0)
    c.completions.create(model="sibyl-model", prompt="only whole", max_tokens=5, extra_body={"ignore_eos": True})
    assert console.stop() == 0
    rows = json.loads(console.cli("runs", "export", console.run_id, "--format", "json").stdout)
    whole = [r for r in rows if r["ttft_source"] == "prefill_end"]
    streamed = [r for r in rows if r["ttft_source"] == "first_token"]
    assert whole and streamed and all(r["status"] == "ok" for r in rows)
    for r in whole:
        assert r["tpot"] is None and r["first_token"] is None
        assert r["ttft"] == pytest.approx(r["prefill_end"] - r["arrival"], abs=1e-6) and r["ttft"] < r["e2e"]
    for r in streamed:
        assert r["tpot"] is not None and r["tpot"] > 1e-4 and r["first_token"] is not None
    shown = console.cli("runs", "show", console.run_id)
    assert shown.returncode == 0, shown.stderr
    assert f"{len(whole)} whole (non-streamed) replies: TPOT not measured" in shown.stdout
    assert "=None" not in shown.stdout


def test_the_docs_show_the_scrape_configuration_and_the_dashboard() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    assert "scrape_configs" in text and "demos/grafana/sibyl-pd.json" in text
