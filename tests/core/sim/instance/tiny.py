"""The tiny profile the instance simulator's hand computations use (tests/core/sim/instance/)."""

from __future__ import annotations

from core.perf import PerfProfile

# prefill chunk of c tokens at offset o: 1 ms/token (+ 1 µs·((o+c)² − o²) in PROF2);
# decode step: 20 ms + 5 ms per sequence; a step without decodes pays 10 ms fixed.
PROF = PerfProfile(
    name="tiny",
    prefill_base_s=0.010,
    prefill_per_token_s=0.001,
    decode_step_base_s=0.020,
    decode_step_per_seq_s=0.005,
    kv_capacity_tokens=16_000,
    block_size=16,
    max_num_seqs=8,
    max_model_len=8192,
)
PROF2 = PROF.model_copy(update={"prefill_per_token2_s": 1e-6, "decode_step_per_kv_token_s": 1e-5})

# τ = 1 ms/token, k = 256 → τk = 0.256 s; u_k = 1 → γ = 1/0.256 s⁻¹.
TAU, K = 0.001, 256
GAMMA = 1.0 / (TAU * K)
