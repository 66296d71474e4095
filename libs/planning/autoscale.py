"""The load-monitor's whole scaling decision as a pure state machine.

``step(state, observed, now) -> (state, decisions)``: the load-monitor feeds,
every tick, one :class:`Observation` (per model: a new metrics sample, the
instances it runs now, the deployment's scaling settings, the newest request
times the gateways report) and publishes the :class:`ScaleDecision` s it gets
back.  Everything between is here, without I/O:

* the sliding window of samples per model (``window_s``, at most
  ``max_samples``);
* the deployment's scaling policy, looked up by name in :data:`POLICIES`;
* the hysteresis around it: a scale-in (to one instance or more) is asked for
  only once the policy has wanted fewer instances for the deployment's
  scale-down delay without a break (the scale to zero has waited out the
  keep-alive already); a request is repeated while the mismatch lasts, but
  the same number not more often than every ``resend_s`` (the planner
  reconciles idempotently); nothing is asked for while the policy wants what
  runs.

The scale-down delay (:func:`scale_down_delay`) is the deployment's
``scale_down_delay_s`` parameter where it sets one (every policy accepts
it); otherwise 0 for a policy with its own scale-down timeout (``threshold``:
BlitzScale's sub-second ``scale_down_timeout_s``; ``slo``), which the
hysteresis must not stretch, and the cluster's ``scale_down_delay_s`` for
the others (``concurrency``: a stabilization window against flapping).

The load-monitor's samples (libs.planning.demand) carry the instance counts,
the requests queued or in flight, the demand in tokens/s (``load_tps``, for
the threshold policy) and the TTFT/TPOT observations of the interval (for
the SLO policy).  A deployment's policy parameters are checked by
:func:`policy_config` (also at deploy time): unknown names and bad values
raise ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from libs.protocol import messages as m
from libs.planning.policies import (
    ConcurrencyPolicy,
    MetricsSample,
    SloPolicy,
    ThresholdPolicy,
    concurrency_policy,
    slo_policy,
    threshold_policy,
)

__all__ = [
    "POLICIES",
    "AutoscaleConfig",
    "AutoscaleState",
    "Deployment",
    "ModelObservation",
    "ModelScaleState",
    "Observation",
    "Policy",
    "ScaleDecision",
    "check_policy",
    "deployment_of",
    "model_observation",
    "policy_config",
    "scale_down_delay",
    "step",
]


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


# ---------------------------------------------------------------------------
# Policies: name -> config builder + decision function
# ---------------------------------------------------------------------------

# The deployment sets these on every policy's config; they are not parameters.
_BOUNDS = ("min_instances", "max_instances")
# Every policy accepts it; it sets the load-monitor's hysteresis, not the policy's config.
SCALE_DOWN_DELAY = "scale_down_delay_s"


@dataclass(frozen=True)
class Deployment:
    """A deployment's scaling settings, as plain values."""

    min_instances: int = 0
    max_instances: int | None = None
    keep_alive_s: float = 60.0
    policy: str = "concurrency"
    params: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", _frozen(self.params))


@dataclass(frozen=True)
class Policy:
    """One scaling policy: its config dataclass and its decision function.

    ``decide(window, config, last_request_at)`` is the policy function;
    ``keep_alive`` names the config field the deployment's keep-alive fills
    (None: the policy has none); ``own_scale_down`` says the policy waits out
    a scale-down timeout of its own (the hysteresis then adds none by
    default).  Every other field of the config without the bounds is a
    parameter a deployment may set, and so is ``scale_down_delay_s``.
    """

    name: str
    config: type
    decide: Callable[[Sequence[MetricsSample], Any, float | None], int]
    keep_alive: str | None = None
    own_scale_down: bool = False

    # Cached: the load-monitor (and `layercast simulate`, 10^4-10^5 ticks a run) builds a config every tick.
    @functools.cached_property
    def params(self) -> tuple[str, ...]:
        fixed = {*_BOUNDS, self.keep_alive}
        return (*(f.name for f in dataclasses.fields(self.config) if f.name not in fixed), SCALE_DOWN_DELAY)

    @functools.cached_property
    def required(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.config) if f.name in self.params
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)

    def check_names(self, params: Mapping[str, Any]) -> None:
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            raise ValueError(f"unknown parameter {unknown[0]!r} for scaling policy {self.name!r} "
                             f"(known: {', '.join(self.params)})")

    def build(self, deployment: Deployment, defaults: Mapping[str, float] | None = None) -> Any:
        """The config for ``deployment``: its parameters over ``defaults`` (the cluster's)."""
        params = {**(defaults or {}), **deployment.params}
        self.check_names(params)
        for key, value in params.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"parameter {key!r} of scaling policy {self.name!r} must be a finite "
                                 f"number >= 0, got {value!r}")
        missing = [p for p in self.required if p not in params]
        if missing:
            raise ValueError(f"scaling policy {self.name!r} needs parameter(s) {', '.join(missing)}")
        fixed: dict[str, Any] = {"min_instances": deployment.min_instances,
                                 "max_instances": deployment.max_instances}
        if self.keep_alive is not None:
            fixed[self.keep_alive] = deployment.keep_alive_s
        try:
            return self.config(**{k: v for k, v in params.items() if k != SCALE_DOWN_DELAY}, **fixed)
        except ValueError as e:
            raise ValueError(f"scaling policy {self.name!r}: {e}") from None


POLICIES: Mapping[str, Policy] = _frozen({p.name: p for p in (
    Policy("threshold", ThresholdPolicy, lambda w, cfg, _last: threshold_policy(w, cfg), own_scale_down=True),
    Policy("concurrency", ConcurrencyPolicy,
           lambda w, cfg, last: concurrency_policy(w, cfg, last_request_at=last), keep_alive="keep_alive_s"),
    Policy("slo", SloPolicy, lambda w, cfg, _last: slo_policy(w, cfg), keep_alive="idle_s", own_scale_down=True),
)})


def _policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scaling policy {name!r} (known: {', '.join(POLICIES)})") from None


def policy_config(deployment: Deployment, defaults: Mapping[str, float] | None = None) -> Any:
    """The policy config of ``deployment``; ValueError on an unknown policy or a bad parameter."""
    return _policy(deployment.policy).build(deployment, defaults)


def scale_down_delay(deployment: Deployment, config: AutoscaleConfig) -> float:
    """How long the policy must want fewer instances (not zero) before the scale-in is asked for:
    the deployment's own ``scale_down_delay_s``, else 0 where the policy has a scale-down timeout
    of its own (it has waited already), else the cluster's."""
    if SCALE_DOWN_DELAY in deployment.params:
        return float(deployment.params[SCALE_DOWN_DELAY])
    return 0.0 if _policy(deployment.policy).own_scale_down else config.scale_down_delay_s


def check_policy(policy: str, params: Mapping[str, float], *, min_instances: int = 0,
                 max_instances: int | None = None, keep_alive_s: float = 60.0) -> None:
    """Deploy-time check of a policy and its parameters (without any cluster defaults)."""
    policy_config(Deployment(min_instances, max_instances, keep_alive_s, policy, params))


# ---------------------------------------------------------------------------
# The state machine
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AutoscaleConfig:
    """The load-monitor's knobs, the same for every model."""

    window_s: float = 10.0  # samples older than this are dropped
    # A scale-in waits until the policy has wanted it this long, for policies without a
    # scale-down timeout of their own where the deployment sets no scale_down_delay_s.
    scale_down_delay_s: float = 0.0
    resend_s: float = 2.0  # the same request is repeated at most this often
    max_samples: int = 1200
    # Per policy, parameter values used where a deployment sets none.
    defaults: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.window_s < 0 or self.scale_down_delay_s < 0 or self.resend_s < 0:
            raise ValueError("window_s, scale_down_delay_s and resend_s must be >= 0")
        if self.max_samples < 1:
            raise ValueError("max_samples must be >= 1")
        for name, params in self.defaults.items():
            _policy(name).check_names(params)
        object.__setattr__(self, "defaults", _frozen({k: _frozen(v) for k, v in self.defaults.items()}))


@dataclass(frozen=True)
class ModelScaleState:
    """What the autoscaler remembers of one model between steps."""

    samples: tuple[MetricsSample, ...] = ()  # oldest first, within the window
    last_request_at: float | None = None  # newest request any gateway reported
    last_sent: tuple[int, float] | None = None  # (desired, when) of the last decision
    below_since: float | None = None  # since when the policy has wanted fewer instances than run
    desired: int | None = None  # the policy's answer at the last step

    @property
    def demand(self) -> int:
        """Requests queued or in flight at the last sample."""
        return self.samples[-1].in_flight if self.samples else 0


@dataclass(frozen=True)
class AutoscaleState:
    config: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    models: Mapping[str, ModelScaleState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", _frozen(self.models))

    def without(self, *names: str) -> AutoscaleState:
        """This state with the named models forgotten (e.g. redeployed: they start afresh)."""
        return dataclasses.replace(self, models={k: v for k, v in self.models.items() if k not in names})


@dataclass(frozen=True)
class ModelObservation:
    sample: MetricsSample  # this tick's sample (t = now)
    current: int  # instances running or loading now
    deployment: Deployment
    last_requests: tuple[float, ...] = ()  # the newest request time each gateway reports


@dataclass(frozen=True)
class Observation:
    """One tick's view of every deployed model; models absent here are forgotten."""

    models: Mapping[str, ModelObservation]

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", _frozen(self.models))


@dataclass(frozen=True)
class ScaleDecision:
    model: str
    desired: int
    current: int
    direction: Literal["up", "down"]
    reason: str


def step(state: AutoscaleState, observed: Observation, now: float) -> tuple[AutoscaleState, list[ScaleDecision]]:
    """One tick: the next state and the scale requests to send, in the observation's model order."""
    models: dict[str, ModelScaleState] = {}
    decisions: list[ScaleDecision] = []
    for name, obs in observed.models.items():
        models[name], decision = _step_model(state.config, name, state.models.get(name, ModelScaleState()),
                                             obs, now)
        if decision is not None:
            decisions.append(decision)
    return dataclasses.replace(state, models=models), decisions


def _window(config: AutoscaleConfig, samples: tuple[MetricsSample, ...], now: float) -> tuple[MetricsSample, ...]:
    samples = samples[-config.max_samples:]
    start = 0
    while start < len(samples) and samples[start].t < now - config.window_s:
        start += 1
    return samples[start:]


def _step_model(config: AutoscaleConfig, name: str, prev: ModelScaleState, obs: ModelObservation,
                now: float) -> tuple[ModelScaleState, ScaleDecision | None]:
    dep = obs.deployment
    samples = _window(config, (*prev.samples, obs.sample), now)
    times = [t for t in (prev.last_request_at, *obs.last_requests) if t is not None]
    last_request_at = max(times) if times else None
    policy = _policy(dep.policy)
    desired = policy.decide(samples, policy.build(dep, config.defaults.get(dep.policy)), last_request_at)
    current = obs.current
    new = ModelScaleState(samples=samples, last_request_at=last_request_at, last_sent=prev.last_sent,
                          below_since=None if desired >= current else prev.below_since, desired=desired)
    if desired == current:
        return dataclasses.replace(new, last_sent=None), None
    if 0 < desired < current:
        # Scale-ins wait out the delay (a burst's dips do not flap instances); the
        # scale to zero has waited for the model's keep-alive already.
        if new.below_since is None:
            new = dataclasses.replace(new, below_since=now)
        if now - new.below_since < scale_down_delay(dep, config):
            return new, None
    if new.last_sent is not None and new.last_sent[0] == desired and now - new.last_sent[1] < config.resend_s:
        return new, None
    load = obs.sample.load_tps
    if desired > current:
        tokens = f", {load:.1f} tokens/s" if load > 0 else ""
        reason = f"demand {new.demand} queued or in flight{tokens}, {current} instance(s)"
    elif policy.own_scale_down:
        reason = f"load {load:.1f} tokens/s, {new.demand} queued or in flight"
    else:
        idle = now - (now if last_request_at is None else last_request_at)
        reason = f"idle for {idle:.1f}s (keep-alive {dep.keep_alive_s}s)"
    decision = ScaleDecision(model=name, desired=desired, current=current,
                             direction="up" if desired > current else "down", reason=reason)
    return dataclasses.replace(new, last_sent=(desired, now)), decision


# ---------------------------------------------------------------------------
# What the load-monitor observes (its service and `layercast simulate` build ticks alike)
# ---------------------------------------------------------------------------


def deployment_of(model: m.ModelInfo) -> Deployment:
    """A deployed model's scaling settings."""
    return Deployment(min_instances=model.min_instances, max_instances=model.max_instances,
                      keep_alive_s=model.keep_alive_s, policy=model.policy, params=model.policy_params)


def model_observation(model: m.ModelInfo, now: float, states: Sequence[m.InstanceState], requests: int,
                      load_tps: float = 0.0, ttft_s: Sequence[float] = (), tpot_s: Sequence[float] = (),
                      last_requests: Sequence[float] = ()) -> ModelObservation:
    """One tick's observation of `model`: `states` of its live instances (loading or ready),
    `requests` queued or in flight at the gateways, the demand in tokens/s and the latencies
    observed since the previous tick, the newest request time each gateway reports."""
    sample = MetricsSample(t=now, ready=sum(1 for s in states if s == m.InstanceState.ready),
                           warming=sum(1 for s in states if s == m.InstanceState.loading), load_tps=load_tps,
                           in_flight=requests, ttft_s=tuple(ttft_s), tpot_s=tuple(tpot_s))
    return ModelObservation(sample=sample, current=len(states), deployment=deployment_of(model),
                            last_requests=tuple(last_requests))
