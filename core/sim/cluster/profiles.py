"""Each simulated instance's profile: its own, from an `instance_profiles` mapping, else the cluster's.

`ClusterSimulation(instance_profiles=...)` maps instance ids ("p0", "d1", ...) to a PerfProfile (the
advisor's: each live instance's calibrated profile, console/live/advisor.py); an instance not listed
runs the cluster's `profile`. What runs on an instance's own profile:

* its prefill steps (step terms, token budget, running slots, host work, wake-up: core/sim/cluster/prefill.py),
  and the dispatcher's projection of them: the same terms, set per instance as the live calibrator sets
  them (`PrefillQueues.set_terms`, what `Dispatcher.set_instance_profile` does live), so routing sees
  what the simulated engine does. An instance whose profile equals the cluster's keeps the shared terms
  (the profile's, with the prefill estimator's coefficients), as an uncalibrated instance does live;
* its decode model (step times or TPS, KV capacity, max_num_seqs, a preempted request's recompute,
  wake-up), and a decode-only request's prefill there;
* the P→D KV pull into it as a decode instance: the pull is the decode instance's, and the online
  fit times hand-offs there (core/calibration/online.py).

What stays cluster-wide, on the cluster's `profile`: the dispatcher's own profile (its decode-rate and
transfer estimates: live, too, only the prefill terms are set per instance); the KV cache model (block
size, which must agree since block keys are cluster-wide, and every instance's prefix-pool capacity);
LoRA load and per-adapter costs; a scaled-up instance's cold start; a migration's transfer (the link
model). An id no instance has yet applies if the scaler starts one by that name. Without the mapping
every instance runs the cluster's profile, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from core.perf import PerfProfile
from core.prefill import StepTerms
from core.sim.cluster.prefill import SimPrefill, step_terms
from core.sim.cluster.result import Mode

if TYPE_CHECKING:
    from core.sim.cluster.cache import SimCache
    from core.sim.cluster.decode import DecodeModel
    from core.view import ClusterView


class InstanceProfiles:
    """The cluster's profile and the instances' own; `of(id)` gives what an instance runs on."""

    def __init__(
        self,
        profile: PerfProfile,
        mode: Mode,
        own: Mapping[str, PerfProfile] | None = None,
        decoders: list[DecodeModel | None] | None = None,
    ) -> None:
        self.profile = profile
        self.decoders = decoders if decoders is not None else []
        """The cluster's decode models: what they stream slows prefill steps where a profile says so."""
        self.mode = mode
        self.own: dict[str, PerfProfile] = dict(own or {})
        for iid, p in self.own.items():
            if p.block_size != profile.block_size:
                raise ValueError(
                    f"instance {iid}'s profile has block size {p.block_size}, the cluster's {profile.block_size}: "
                    "the KV cache model keys blocks cluster-wide"
                )
        self.shared_terms = step_terms(profile, mode)
        self.at: list[PerfProfile] = []
        """Per dispatcher index: the profile the instance runs on (`prefill` appends it)."""

    def of(self, instance_id: str) -> tuple[PerfProfile, StepTerms, bool]:
        """The instance's profile, its prefill step terms, and whether the dispatcher must project it with
        those terms (its own profile differs from the cluster's) rather than the shared ones."""
        own = self.own.get(instance_id)
        if own is None:
            return self.profile, self.shared_terms, False
        if own == self.profile:
            return own, self.shared_terms, False
        return own, step_terms(own, self.mode), True

    def prefill(self, x: int, view: ClusterView, prompts: list[int], cache: SimCache | None) -> SimPrefill:
        """Instance x's prefill engine on its profile (`at[x]`); when its terms are its own the dispatcher's
        projection of instance x takes them too."""
        profile, terms, own = self.of(view.instance_ids[x])
        if own:
            view.queues.set_terms(x, terms)
        pf = SimPrefill(x, terms, prompts, cache)
        pf.wake = profile.wake_time if profile.idle_wake_s > 0 else None
        pf.arrival_stretch = profile.prefill_arrival_stretch_s
        if profile.host_per_streamed_token_s > 0:
            decoders = self.decoders
            pf.stretch = lambda: profile.host_stretch(sum(d.token_rate() for d in decoders if d is not None))
        self.at.append(profile)
        return pf
