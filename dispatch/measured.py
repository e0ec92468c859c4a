"""A backend's measured figures as dispatch keeps them: its fit, the feed of samples, the spec routing uses.

The gateway (`gateway.backends.backend_set`, at each scrape) and the simulator (`sim.simulator`,
at its scrapes) both close the feed's interval here, and the fit (`router.kappa_fit`) moves the
backend's routed spec by the blend `router.link_factors` states: the target's ``spec`` is
replaced on a scrape, never per request, and only when a blended factor moved by a rounding step
(`router.link_factors.MeasurementSettings.resolution`). A restart of the backend resets the fit
and the spec to the profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dispatch.prefill_feed import PrefillFeed
from router.cost import BackendSpec
from router.kappa_fit import KappaCritFit, KappaCritMeasurement
from router.link_factors import (
    PROFILE,
    LinkFactorEstimates,
    LinkFactors,
    MeasurementSettings,
    deviations,
    measured_spec,
    routed_factors,
)

__all__ = ["MeasuredFigures"]


@dataclass(eq=False)
class MeasuredFigures:
    """One backend's fit, its feed and the spec routing uses (module docstring).

    Args:
        profile: the configured spec (what the fit measures against).
        settings: the blend, the fit's time constant, the deviation threshold; ``enabled`` False
            keeps ``spec`` at ``profile``.

    Attributes:
        fit: the online fit (`router.kappa_fit.KappaCritFit`).
        feed: its samples (`dispatch.prefill_feed.PrefillFeed`).
        factors: the blended factors ``spec`` is priced at.
        spec: the spec routing uses: ``profile`` until a blended factor leaves 1.
        observed: intervals the fit took, ever (a count that moves when the fit may have).
    """

    profile: BackendSpec
    settings: MeasurementSettings = field(default_factory=MeasurementSettings)
    feed: PrefillFeed = field(init=False)
    fit: KappaCritFit = field(init=False)
    factors: LinkFactors = field(default=PROFILE, init=False)
    spec: BackendSpec = field(init=False)
    observed: int = field(default=0, init=False)
    _told: set[str] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self.fit = KappaCritFit(self.profile, self.settings.time_constant_s)
        self.feed = PrefillFeed(self.profile)
        self.spec = self.profile

    def scraped(self, count: float | None, sum_s: float, now_s: float, loaded_tokens: float | None = None) -> bool:
        """A scrape of the prefill-time histogram (``_count``, ``_sum``; count None: not exported) and of
        the engine's loaded-token counter at ``now_s``: the feed's interval closes and the fit takes the
        intervals laid out (`dispatch.prefill_feed.PrefillFeed.scraped`). Returns whether ``spec`` changed."""
        self.fit.measurement()  # its rates are current: the schedule prices the engine's steps at them
        observed = [iv for iv in self.feed.scraped(count, sum_s, end_s=now_s, rates=self.fit.rates,
                                                   loaded_tokens=loaded_tokens) if self.fit.observe(iv)]
        if not observed:
            return False
        self.observed += len(observed)
        return self.reprice()

    def measurement(self) -> KappaCritMeasurement | None:
        """The fit's current answer (`router.kappa_fit.KappaCritFit.measurement`)."""
        return self.fit.measurement()

    def reprice(self) -> bool:
        """Blend the fit's factors into ``spec`` (the profile when disabled); whether it changed."""
        factors = routed_factors(self._estimates(), self.settings) if self.settings.enabled else PROFILE
        if factors == self.factors:
            return False
        self.factors = factors
        self.spec = measured_spec(self.profile, factors)
        return True

    def restarted(self) -> bool:
        """The backend restarted: forget the evidence, price it at the profile again. Returns whether
        ``spec`` changed."""
        self.fit.reset()
        self._told.clear()
        if self.factors == PROFILE:
            return False
        self.factors, self.spec = PROFILE, self.profile
        return True

    def deviations(self) -> dict[str, float]:
        """Measured factors beyond ``settings.deviation_ratio`` of the profile, by factor name
        (`router.link_factors.deviations`)."""
        return deviations(self._estimates(), self.settings.deviation_ratio)

    def new_deviations(self) -> dict[str, float]:
        """`deviations` not returned before (since the last restart): what to log, once each."""
        found = {k: v for k, v in self.deviations().items() if k not in self._told}
        self._told.update(found)
        return found

    def _estimates(self) -> LinkFactorEstimates | None:
        m = self.fit.measurement()
        return None if m is None else m.factors
