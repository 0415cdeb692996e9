"""The live console's `[admission]` settings: SLO admission's bounds, margins and engine limits."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SloAdmission(BaseModel):
    """Admission that protects the SLO (the live console's `[admission]` settings).

    Arrivals are routed while the cluster can start them within their target (their own service,
    prefill alone and hand-off, plus a margin × what it leaves of their class's TTFT target; the
    margin moves between headroom and 1 to hold ttft_attainment_goal of the admitted in SLO): a
    decode slot is free (slots per decode instance start from vLLM's max_num_seqs and the TPOT
    target on the profile, then follow what the decode engines report and the measured TPOT)
    and the least-loaded prefill instance's backlog (the dispatcher's projections corrected by the
    measured TTFT, or the engine's own waiting requests if more) leaves room for the prompt.
    Otherwise a request is held in the queue policy's order if it is expected to start within its
    wait bound (TTFT target + extra_wait_s), or refused at once with 429 and Retry-After; a held
    request that can no longer start within its wait bound is answered 503 with Retry-After.
    A saturation only the prior projects (no engine reports a queue, too little measured to back
    the projection) is not refused at once: the request is held up to evidence_hold_s, then
    judged again with what was measured meanwhile.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        True, description="hold and shed by the SLO (off: only the queue policy's max_in_flight_per_instance)"
    )
    decode_slots: int | None = Field(
        None,
        ge=1,
        description="requests in flight per decode instance; none: vLLM's max_num_seqs (the profile's), cut to the "
        "most whose decode step stays within headroom × the tightest TPOT target",
    )
    headroom: float = Field(
        0.8,
        gt=0,
        le=1,
        description=(
            "the least share of a request's TTFT target, after its own service (its prefill alone and the hand-off), "
            "that the queue projected ahead of it may take: the margin moves between this and 1 "
            "(ttft_attainment_goal), and stays here with a goal of 1; the rest covers what the projection of that "
            "queue cannot know: how many prompts will join its step (docs/admission.md)"
        ),
    )
    ttft_attainment_goal: float = Field(
        0.95,
        ge=0.5,
        le=1,
        description=(
            "the margin moves between headroom and 1 to keep this share of the admitted within their TTFT target: "
            "it learns from the whole target, tightening on each admitted request that misses it (heard once "
            "certain: past its target before its decode began) and loosening on each that meets it, and is "
            "headroom until eight were judged; 1 keeps it at headroom "
            "(fewer refusals below capacity, more of the admitted missing at 2-3x capacity: docs/admission.md)"
        ),
    )
    extra_wait_s: float = Field(
        0.0,
        ge=0,
        description="the bounded wait: a request expected to start up to this long after its TTFT target is still held "
        "(its wait bound is TTFT target + this); 0 admits only what is expected to meet the SLO",
    )
    local_prefill: bool = Field(
        True,
        description=(
            "a request the prefill pool would start past its target goes instead to a decode instance that computes "
            "its prompt itself (no prefill leg), if its first token comes out there in time and every request "
            "decoding there keeps headroom x its TPOT target with the stall (docs/admission.md); off: refused"
        ),
    )
    kv_high: float = Field(
        0.95, gt=0, le=1, description="a decode instance whose polled KV usage is at least this takes no new request"
    )
    evidence_hold_s: float = Field(
        0.5,
        ge=0,
        description=(
            "a request refused only by the prior's projection (no engine reports a queue, too few measured TTFTs "
            "or TPOTs back it) is held up to this long instead, then judged again (a wrong prior costs the first "
            "requests latency, not refusals)"
        ),
    )
    waiting_high: int = Field(
        8,
        ge=1,
        description=(
            "a decode instance whose engine reports this many waiting "
            "requests (out of slots or KV) takes no new request"
        ),
    )
