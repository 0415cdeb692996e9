"""The LoRA sweep's floor: Belady's MIN on hand-traced adapter sequences, and the table's "most cut"."""

from __future__ import annotations

from benchmarks.lora_sweep import TARGET, fewest_loads, table


def test_fewest_loads_evicts_the_adapter_needed_furthest_ahead() -> None:
    # two slots: a and b load; c loads and evicts b (next needed at 4, a at 3); a hits; b loads and
    # evicts a (never needed again, c at 5); c hits: four loads, where LRU would make six
    assert fewest_loads(["a", "b", "c", "a", "b", "c"], 2) == 4
    assert fewest_loads(["a", None, "a", None], 1) == 1  # base-model requests load nothing
    assert fewest_loads(["a", "b", "a", "b"], 1) == 4
    assert fewest_loads(["a", "b", "c"], 3) == 3  # cold loads count


def test_the_table_sets_each_cut_beside_the_most_any_routing_could_make() -> None:
    common = {"ttft_p50": 1.0, "ttft_p99": 2.0, "lora_loads_per_min": 1.0, "slo_attainment": 0.9, "tpot_p99": 0.02}
    rows = [
        {"cell": TARGET, "label": "least_load", "fewest_loads": 100, "lora_loads": 400, **common},
        {"cell": TARGET, "label": "affinity(least_load)", "fewest_loads": 100, "lora_loads": 200, **common},
    ]
    last = table(rows).splitlines()[-1].split(" | ")
    assert last[7:9] == ["2.0×", "4.0×"]
