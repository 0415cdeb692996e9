"""`status` shows admission's refusals by cause and each instance's fitted terms with residual, age and source."""

from __future__ import annotations

from rich.console import Console

from console.commands.status import _calibration_table, queue_line, refusals_line
from console.live.state import ConsoleState, QueueState


def state() -> ConsoleState:
    return ConsoleState.model_validate(
        {
            "instances": [
                {
                    "id": "p0",
                    "role": "prefill",
                    "backlog_s": 2.9,
                    "calibration": {
                        "calibrated": True,
                        "fitted_age_s": 3.0,
                        "terms": {
                            "prefill_per_token_s": {
                                "value": 2e-5,
                                "prior": 2e-4,
                                "source": "fit",
                                "residual": 0.05,
                                "samples": 40,
                                "age_s": 1.0,
                            },
                            "kv_transfer_base_s": {
                                "value": 0.002,
                                "prior": 0.002,
                                "source": "prior: no samples of the constant yet",
                            },
                        },
                        "check": {"prefill": {"measured_s": 0.0222, "projected_s": 0.0224}},
                    },
                },
                {"id": "d0", "role": "decode"},
            ],
            "queue": QueueState.model_validate(
                {
                    "refusals": {
                        "prefill_backlog": {"count": 37, "last_projected_s": 2.9, "bound_s": 1.6},
                        "kv": {"count": 0, "last_projected_s": 0.0, "bound_s": 0.0},
                        "tenant_limit": {"count": 2, "last_projected_s": 4.0, "bound_s": 0.0},
                    }
                }
            ),
        }
    )


def test_refusals_by_cause_with_the_projected_wait_against_the_bound() -> None:
    s = state()
    assert s.queue is not None and s.queue.refusals is not None
    assert refusals_line(s.queue.refusals) == (
        "refused by cause: prefill backlog 37 (last projected 2.90 s against 1.60 s); tenant limit 2"
    )
    assert refusals_line({}) == "refused by cause: none"


def test_the_calibration_table_lists_every_term_and_says_why_a_prior_is_kept() -> None:
    con = Console(record=True, width=200)
    con.print(_calibration_table(state()))
    text = con.export_text()
    assert "p0 (calibrated, refit 3 s ago)" in text and "prefill measured 22.2 ms, projected 22.4 ms" in text
    assert "prefill_per_token_s" in text and "2e-05" in text and "0.0002" in text and "5%" in text and "40" in text
    assert "prior: no samples of the constant yet" in text
    assert "d0" not in text  # no calibration yet: no rows


def test_an_instance_projected_with_its_peers_terms_says_so_and_until_when() -> None:
    source = "peers' terms until 20 requests of its own (2 so far); its own: 0.0004, prior × 2, scaled"
    term = {"value": 2e-5, "prior": 2e-4, "source": source}
    p1 = {"calibrated": False, "from_peers": True, "fitted_age_s": 0.0, "terms": {"prefill_per_token_s": term}}
    s = ConsoleState.model_validate({"instances": [{"id": "p1", "role": "prefill", "calibration": p1}]})
    con = Console(record=True, width=300)
    con.print(_calibration_table(s))
    text = con.export_text()
    assert "p1 (peers' terms, refit 0 s ago)" in text and source in text


def test_the_queue_line_shows_admissions_margin_when_it_moves() -> None:
    admission = {
        "decode_slots": 154,
        "prefill_s_per_request": 0.24,
        "wait_bound_s": 2.0,
        "extra_wait_s": 0.0,
        "shed": 3,
        "expired": 1,
        "margin": 0.905,
        "headroom": 0.8,
        "ttft_attainment_goal": 0.95,
    }
    line = queue_line(QueueState.model_validate({"depth": 2, "admission": admission}))
    assert line.startswith("queue 2 held; SLO admission: 154 decode slots per instance")
    assert line.endswith("shed 3, expired 1; margin 0.905 (headroom 0.8 to 1, for 95% of the admitted within TTFT)")
    fixed = queue_line(QueueState.model_validate({"depth": 2, "admission": {**admission, "ttft_attainment_goal": 1}}))
    assert fixed.endswith("shed 3, expired 1")  # the margin does not move: headroom is in the config
    local = {**admission, "ttft_attainment_goal": 1, "local_prefill": True, "served_on_decode": 7}
    assert queue_line(QueueState.model_validate({"depth": 2, "admission": local})).endswith(
        "shed 3, expired 1; prefill on decode: 7 served there"
    )
    off = QueueState.model_validate({"depth": 0, "max_in_flight_per_instance": 256})
    assert queue_line(off) == "queue 0 held; SLO admission off (256 in flight per decode instance)"
