"""The router's values survive pickling, compiled or not: the simulator's forked workers send
their results (which hold each backend's `BackendSpec`) back to the parent by pickle, and a
frozen dataclass compiled by mypyc cannot be unpickled field by field (it raised
FrozenInstanceError in `sim.runner.run_jobs` before these classes pickled by constructor)."""

from __future__ import annotations

import pickle

from fleet_config import default_catalog, parse_settings
from router.cost import RequestShape, predict
from router.types import BackendView, Candidate, Decision, RequestFeatures


def test_specs_features_views_and_decisions_round_trip_through_pickle() -> None:
    doc = {"backends": [{"id": "a", "url": "http://127.0.0.1:9", "model": "llama-3.1-8b", "hardware": "h100-sxm",
                         "power_cap_w": 450, "tensor_parallel": 2}],
           "kv_pool": {"capacity_gb": 64, "link_gb_s_per_gpu": 25}}
    catalog = default_catalog()
    settings = parse_settings(doc, catalog, env={})
    spec = settings.backend_spec(catalog, settings.backends[0])
    estimate = predict(RequestShape(4096, 512, 1024, 16, 256, 0, 2), spec, queue_wait_s=0.25)
    decision = Decision("kappa", (Candidate("a", 4096, 512, 1024, estimate, True, 256),), "least predicted TTFT")
    for value in (spec, RequestFeatures("llama-3.1-8b", 5888, 16, 92, 64.0, 2), BackendView("a", spec, 92, 64),
                  estimate, decision):
        copy = pickle.loads(pickle.dumps(value))
        assert copy == value and type(copy) is type(value)
    copy = pickle.loads(pickle.dumps(spec))
    assert (copy.kappa_crit_linear, copy.kv_pool_link_bytes_per_s) == (spec.kappa_crit_linear, spec.kv_pool_link_bytes_per_s)
