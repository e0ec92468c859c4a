"""Predicted prefill time, TTFT, E2E latency and energy of one request on one backend.

The κ quantities come from `router.kappa`; this module turns them into seconds and joules
for a concrete backend (DESIGN.md §3, "Cost of a request on backend b, tiers explicit"):

    t_compute = prefill_flops(K, T) / C_eff
    t_load    = kv_bytes(K_host) / BW_link + kv_bytes(K_pool) / BW_pool
                (KV in HBM is read in place, not loaded; K_pool: blocks found only in a
                 fleet-shared KV pool, loaded at that pool's bandwidth into this backend)
    t_hbm     = (weights read + kv_bytes(K + T)) / HBM bandwidth   (the floor of a short prefill)
    prefill   = max(t_compute, t_hbm, t_load)   when the backend overlaps loads with compute
                                         (layer-wise, LMCache-style), else max(t_compute, t_hbm) + t_load
    decode    = (active weight bytes + kv_bytes(context)) / (HBM bandwidth · TP)   per token
    TTFT      = queue wait + prefill   (vLLM samples the first token at the end of the prefill step)
    E2E       = TTFT + (output_tokens − 1) · decode
    power     = idle + (P_max − idle) · utilisation,  P_max = min(power cap, TDP)
    energy    = power(prefill utilisation) · prefill + power(decode) · decode time

Prefill utilisation is t_compute / prefill (a transfer-bound prefill leaves the SMs idle,
which is why the paper saw 22–28% of TDP on such work). Decode is HBM-bound; its power uses
DECODE_POWER_UTILISATION. The figures are one request alone on the backend: the gateway
adds queueing from its own ledger, the simulator and mock engine model batching.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from router import kappa
from router.kappa import Regime
from router.profiles import GB, HardwareProfile, ModelProfile

# Share of the dynamic power budget that HBM-bound decode draws. An assumption (decode
# keeps HBM busy and the SMs mostly waiting); replace with a measured figure per backend.
DECODE_POWER_UTILISATION = 0.5


def weights_read_bytes(model: ModelProfile, batch_tokens: float) -> float:
    """Weight bytes one forward pass over ``batch_tokens`` tokens reads from HBM (dense: all of
    them; MoE: the experts the batch touches, 1 − (1 − active/total)^n of them; see
    `router.kappa.ModelConstants.weights_read_bytes`)."""
    return kappa.model_constants(model).weights_read_bytes(batch_tokens)


def kv_pool_link_gb_s(hardware: HardwareProfile, tensor_parallel: int, *, link_gb_s_per_gpu: float,
                   host_link_gb_s: float | None = None) -> float:
    """Sustained bandwidth from a fleet-shared KV pool into a backend's HBM, GB/s for its TP group.

    min(the pool network's ``link_gb_s_per_gpu``, the host link per GPU) × TP: the pool's
    bytes arrive over the network and then cross the GPU's own host link (PCIe, or
    NVLink-C2C on Grace Hopper), whichever is slower. ``host_link_gb_s`` is the backend's
    measured override for its whole TP group (else the profile's sustained figure).
    """
    per_gpu_host = (host_link_gb_s / tensor_parallel if host_link_gb_s is not None
                    else hardware.host_link_sustained_bytes_per_s / GB)
    return min(link_gb_s_per_gpu, per_gpu_host) * tensor_parallel


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """A backend's static figures: model, hardware and deployment settings.

    Args:
        model, hardware: the profiles it runs.
        power_cap_w: board power cap in W (``None``: TDP); scales compute, not bandwidth.
        tensor_parallel: GPUs in the TP group (compute, HBM bytes and bandwidth scale by it).
        host_link_gb_s: measured sustained host→HBM bandwidth in GB/s, overriding the profile's.
        overlap_host_load: loads overlap compute (max) or precede it (sum).
        kv_pool_link_gb_s: sustained bandwidth from the fleet-shared KV pool into this backend's
            HBM, GB/s for the whole TP group (``None``: no pool); `kv_pool_link_gb_s` derives it.
        compute_time_ratio, hbm_time_ratio: measured over profiled seconds of compute and of HBM
            reads (> 0; 1: the profile): C_eff and the HBM bandwidth are divided by them
            (`router.link_factors.measured_spec`; the links are measured as ``*_gb_s``).

    The derived fields (``c_eff_flops_per_s``, ``link_bytes_per_s``, ``kv_pool_link_bytes_per_s``
    (0 without a pool), ``kappa_hw``,
    ``kappa_crit_linear``, ``max_power_w``, ``idle_power_w``, ``hbm_bandwidth_bytes_per_s``) are
    computed once at construction: the router reads them for every candidate.
    """

    model: ModelProfile
    hardware: HardwareProfile
    power_cap_w: float | None = None
    tensor_parallel: int = 1
    host_link_gb_s: float | None = None
    overlap_host_load: bool = True
    kv_pool_link_gb_s: float | None = None
    compute_time_ratio: float = 1.0
    hbm_time_ratio: float = 1.0
    c_eff_flops_per_s: float = field(init=False)
    link_bytes_per_s: float = field(init=False)
    kv_pool_link_bytes_per_s: float = field(init=False)
    kappa_hw: float = field(init=False)
    # κ_crit = κ_M · κ_HW with linear F_pf, at the host link: the paper's per-backend figure
    # (REFERENCE.md §1), T-independent. A request's own threshold is `CostEstimate.kappa_crit`.
    kappa_crit_linear: float = field(init=False)
    max_power_w: float = field(init=False)  # P_max = min(power cap, TDP) × TP, W
    idle_power_w: float = field(init=False)  # W
    hbm_bandwidth_bytes_per_s: float = field(init=False)  # × TP

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError("tensor_parallel must be >= 1")
        if self.kv_pool_link_gb_s is not None and self.kv_pool_link_gb_s <= 0:
            raise ValueError("kv_pool_link_gb_s must be > 0 (or None: no pool)")
        if not (self.compute_time_ratio > 0 and self.hbm_time_ratio > 0):
            raise ValueError("compute_time_ratio and hbm_time_ratio must be > 0")
        c_eff = kappa.c_eff_flops_per_s(self.hardware, power_cap_w=self.power_cap_w,
                                        tensor_parallel=self.tensor_parallel) / self.compute_time_ratio
        link = (
            self.host_link_gb_s * GB
            if self.host_link_gb_s is not None
            else self.hardware.host_link_sustained_bytes_per_s * self.tensor_parallel
        )
        kappa_hw = kappa.kappa_hw(link, c_eff)
        object.__setattr__(self, "c_eff_flops_per_s", c_eff)
        object.__setattr__(self, "link_bytes_per_s", link)
        object.__setattr__(self, "kv_pool_link_bytes_per_s", (self.kv_pool_link_gb_s or 0.0) * GB)
        object.__setattr__(self, "kappa_hw", kappa_hw)
        object.__setattr__(self, "kappa_crit_linear", kappa.kappa_crit(self.model, kappa_hw))
        cap = self.hardware.tdp_w if self.power_cap_w is None else min(self.power_cap_w, self.hardware.tdp_w)
        object.__setattr__(self, "max_power_w", cap * self.tensor_parallel)
        object.__setattr__(self, "idle_power_w", self.hardware.idle_power_w * self.tensor_parallel)
        object.__setattr__(self, "hbm_bandwidth_bytes_per_s",
                           self.hardware.hbm_bandwidth_bytes_per_s * self.tensor_parallel / self.hbm_time_ratio)

    def __reduce__(self) -> tuple[type[BackendSpec], tuple[object, ...]]:
        """Pickled as its constructor's arguments (the derived fields are recomputed): a frozen
        class compiled by mypyc (`hot_path`) cannot be unpickled field by field."""
        return (BackendSpec, (self.model, self.hardware, self.power_cap_w, self.tensor_parallel, self.host_link_gb_s,
                              self.overlap_host_load, self.kv_pool_link_gb_s, self.compute_time_ratio,
                              self.hbm_time_ratio))

    def power_w(self, utilisation: float) -> float:
        """Power draw at a utilisation in [0, 1]: idle + (P_max − idle) · u, W."""
        u = min(max(utilisation, 0.0), 1.0)
        return self.idle_power_w + (self.max_power_w - self.idle_power_w) * u


class RequestShape(NamedTuple):
    """What a request asks of a backend, in tokens.

    Args:
        cached_hbm_tokens: prefix tokens already resident in HBM there (read in place).
        cached_host_tokens: prefix tokens cached in the host tier there (must be loaded).
        uncached_prompt_tokens: T, prompt tokens to prefill (≥ 0; vLLM always computes at least one).
        output_tokens: tokens to generate (max_tokens).
        cached_kv_pool_tokens: prefix tokens found only in the fleet-shared KV pool (loaded
            from it; 0 without a pool).
        held_tokens: prefix tokens whose KV other requests in flight on the backend already
            hold (and were charged for): left out of ``kv_demand_bytes``, ≤ cached_hbm_tokens.
        sequences: output sequences generated from the prompt (OpenAI's ``n``, ≥ 1). vLLM's v1
            engine fans ``n`` out into n child requests of the same prompt
            (``vllm/v1/engine/parallel_sampling.py``, ``ParentRequest``) whose prompt blocks the
            prefix cache shares: the prompt's KV is held once, each sequence's output KV apart.
    """

    cached_hbm_tokens: float
    cached_host_tokens: float
    uncached_prompt_tokens: float
    output_tokens: float = 1
    cached_kv_pool_tokens: float = 0.0
    held_tokens: float = 0.0
    sequences: int = 1

    @property
    def cached_tokens(self) -> float:
        return self.cached_hbm_tokens + self.cached_host_tokens + self.cached_kv_pool_tokens

    @property
    def prompt_tokens(self) -> float:
        return self.cached_tokens + self.uncached_prompt_tokens


class CostEstimate(NamedTuple):
    """Predicted figures for one request on one backend (seconds, joules, bytes).

    The κ figures (names as in `router.kappa`'s glossary; dimensionless):
        kappa_ratio: K / T, every cached prompt token (HBM + host tier + KV pool) over the
            uncached ones (the paper's κ_ratio; the ``x-kappa-ratio`` header).
        kappa_ratio_loaded: K_loaded / T, the host-tier and pool tokens that must be loaded
            (``x-kappa-ratio-loaded``).
        kappa_crit: this request's own threshold on this backend: the attention-aware
            κ_crit(T, K_hbm) at the link its loads cross (`predict`; ``x-kappa-crit``).
            ``math.inf`` where no K makes it transfer-bound. It differs from the backend's
            `BackendSpec.kappa_crit_linear` (linear F_pf, host link, T-independent).
        regime: ``TRANSFER`` iff t_load > t_compute, which is iff kappa_ratio_loaded > kappa_crit.
    """

    t_compute_s: float
    t_load_s: float
    prefill_s: float
    decode_step_s: float
    ttft_s: float
    e2e_s: float
    energy_j: float
    load_bytes: float
    kv_demand_bytes: float
    kappa_ratio: float
    kappa_ratio_loaded: float
    kappa_crit: float
    regime: Regime


class Roofline(NamedTuple):
    """One forward pass (a prefill, or an engine step) on a backend: its time by resource.

    Attributes:
        compute_s: FLOPs / C_eff.
        hbm_s: bytes read from and written to HBM / HBM bandwidth.
        load_s: host-tier KV bytes / host link + pool KV bytes / pool link.
        duration_s: max(compute, HBM, load) when loads overlap compute, else max(compute, HBM) + load.
        utilisation: max(compute, DECODE_POWER_UTILISATION · HBM) / duration, in [0, 1]: what
            `BackendSpec.power_w` is drawn at.
    """

    compute_s: float
    hbm_s: float
    load_s: float
    duration_s: float
    utilisation: float


def roofline(backend: BackendSpec, *, flops: float, hbm_bytes: float, host_load_bytes: float = 0.0,
             kv_pool_load_bytes: float = 0.0) -> Roofline:
    """The roofline of one pass: the one definition the router's prediction and the mock
    engine's step time share (module docstring; DESIGN.md §3).

    Raises:
        ValueError: ``kv_pool_load_bytes`` on a backend without a pool link.
    """
    compute = flops / backend.c_eff_flops_per_s
    hbm = hbm_bytes / backend.hbm_bandwidth_bytes_per_s
    load = host_load_bytes / backend.link_bytes_per_s
    if kv_pool_load_bytes:
        if not backend.kv_pool_link_bytes_per_s:
            raise ValueError("a KV pool load on a backend without a pool link (kv_pool_link_gb_s)")
        load += kv_pool_load_bytes / backend.kv_pool_link_bytes_per_s
    base = max(compute, hbm)
    duration = max(base, load) if backend.overlap_host_load else base + load
    utilisation = max(compute, DECODE_POWER_UTILISATION * hbm) / duration if duration > 0 else 0.0
    return Roofline(compute, hbm, load, duration, utilisation)


def kv_demand_bytes(c: kappa.ModelConstants, prompt_tokens: float, shape: RequestShape) -> float:
    """KV bytes the request occupies on the backend: its prompt once (less what requests in flight
    there already hold), plus each of its ``sequences`` outputs (`RequestShape`).

    = kv_bytes(P + out − held) + (n − 1) · (kv_bytes(P + out) − kv_bytes(P)): the first sequence
    with the prompt, and each further one the KV its own output adds (exact for full attention;
    for sliding-window layers it counts each sequence's window as the first one's).
    """
    first = c.kv_bytes(prompt_tokens + shape.output_tokens - min(shape.held_tokens, shape.cached_hbm_tokens))
    if shape.sequences <= 1:
        return first
    per_sequence = c.kv_bytes(prompt_tokens + shape.output_tokens) - c.kv_bytes(prompt_tokens)
    return first + (shape.sequences - 1) * per_sequence


def predict(shape: RequestShape, backend: BackendSpec, *, queue_wait_s: float = 0.0) -> CostEstimate:
    """Predict TTFT, E2E and energy of ``shape`` on ``backend`` (formulas in the module docstring).

    Args:
        shape: the request's cached (by tier) and new tokens.
        backend: the backend's static figures.
        queue_wait_s: expected wait before the prefill starts, s (the caller's estimate).

    Returns:
        A `CostEstimate`; ``kappa_crit`` is the attention-aware κ_crit(T, K_hbm) of this
        backend (`router.kappa.ModelConstants.kappa_crit`), at the bandwidth this request's
        loads average over its host and pool links (the host link's when nothing is loaded),
        and ``regime`` compares the t_load and t_compute of this request: transfer exactly
        when ``kappa_ratio_loaded`` > ``kappa_crit``. This is the one computation of a
        request's κ_crit: the gateway's headers and ``/v1/kappa/route`` and ``kappa-gateway
        crit --backend`` all read it from here.

    Raises:
        ValueError: cached pool tokens on a backend without a pool link.
    """
    return with_queue_wait(predict_unqueued(shape, backend), queue_wait_s)


class UnqueuedEstimate(NamedTuple):
    """`predict`'s figures for a request that waits for nothing, and its decode time: adding a
    queue wait (`with_queue_wait`) moves only TTFT and E2E, so one of these serves every backend
    with the same spec and the same K by tier (`router.candidates.build_candidates`).

    Attributes:
        estimate: the `CostEstimate` at queue wait 0.
        decode_s: (output tokens − 1) · decode step, seconds (E2E − TTFT).
    """

    estimate: CostEstimate
    decode_s: float


def with_queue_wait(unqueued: UnqueuedEstimate, queue_wait_s: float) -> CostEstimate:
    """The estimate after ``queue_wait_s`` seconds of queue: TTFT = wait + prefill and
    E2E = TTFT + decode, in the same float operations as ever (decisions are bit-for-bit those
    of one `predict` per backend)."""
    est = unqueued.estimate
    if queue_wait_s == 0.0:
        return est
    ttft = queue_wait_s + est.prefill_s
    return CostEstimate(est.t_compute_s, est.t_load_s, est.prefill_s, est.decode_step_s, ttft,
                        ttft + unqueued.decode_s, est.energy_j, est.load_bytes, est.kv_demand_bytes, est.kappa_ratio,
                        est.kappa_ratio_loaded, est.kappa_crit, est.regime)


def predict_unqueued(shape: RequestShape, backend: BackendSpec) -> UnqueuedEstimate:
    """`predict` at queue wait 0, with the decode time apart (`UnqueuedEstimate`).

    Raises:
        ValueError: cached pool tokens on a backend without a pool link.
    """
    c = kappa.model_constants(backend.model)
    cached = shape.cached_hbm_tokens + shape.cached_host_tokens + shape.cached_kv_pool_tokens
    prompt = cached + shape.uncached_prompt_tokens
    uncached = max(shape.uncached_prompt_tokens, 1.0)
    host_bytes = c.kv_bytes(shape.cached_host_tokens)
    kv_pool_bytes = c.kv_bytes(shape.cached_kv_pool_tokens) if shape.cached_kv_pool_tokens else 0.0
    pf = roofline(backend, flops=c.prefill_flops(cached, uncached),
                  hbm_bytes=c.weights_read_bytes(uncached) + c.kv_bytes(prompt),
                  host_load_bytes=host_bytes, kv_pool_load_bytes=kv_pool_bytes)
    load_bytes = host_bytes + kv_pool_bytes
    loaded = shape.cached_host_tokens + shape.cached_kv_pool_tokens
    # κ_crit at the link this request's loads cross: the host link's, or with pool tokens the
    # bandwidth its loads average (bytes / t_load), so regime and κ_crit agree on every backend.
    kappa_hw = backend.kappa_hw
    if kv_pool_bytes:
        kappa_hw = kappa.kappa_hw(load_bytes / pf.load_s, backend.c_eff_flops_per_s)
    context = prompt + shape.output_tokens / 2.0
    decode_step = (c.active_weight_bytes + c.kv_bytes(context)) / backend.hbm_bandwidth_bytes_per_s
    decode_time = max(shape.output_tokens - 1.0, 0.0) * decode_step
    energy = (backend.power_w(pf.utilisation) * pf.duration_s
              + backend.power_w(DECODE_POWER_UTILISATION) * decode_time)
    return UnqueuedEstimate(CostEstimate(
        t_compute_s=pf.compute_s,
        t_load_s=pf.load_s,
        prefill_s=pf.duration_s,
        decode_step_s=decode_step,
        ttft_s=pf.duration_s,
        e2e_s=pf.duration_s + decode_time,
        energy_j=energy,
        load_bytes=load_bytes,
        kv_demand_bytes=kv_demand_bytes(c, prompt, shape),
        kappa_ratio=kappa.kappa_ratio(cached, shape.uncached_prompt_tokens),
        kappa_ratio_loaded=kappa.kappa_ratio(loaded, shape.uncached_prompt_tokens),
        kappa_crit=c.kappa_crit(kappa_hw, uncached, cached_hbm_tokens=shape.cached_hbm_tokens, loaded_tokens=loaded,
                                bytes_per_loaded_token=load_bytes / loaded if loaded > 0 else None),
        regime=Regime.TRANSFER if pf.load_s > pf.compute_s else Regime.COMPUTE,
    ), decode_time)
