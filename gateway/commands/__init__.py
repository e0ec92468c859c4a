"""The ``kappa-gateway`` command line and the offline tools beside the edge.

``cli`` (the typer app), ``crit`` (κ_crit tables), ``demo`` and ``demo_report`` (mock fleet +
gateway + traffic + report), ``replay`` and ``replay_report`` (a trace against any OpenAI
URL), ``sim_command`` (policies compared in virtual time), ``fleet`` and ``fleet_worker``
(mock backends for a config), ``processes`` (child processes: ports, readiness, stopping),
``hot_path_cli`` (what of the compiled hot path runs; the image's check that all of it does).

This room may import every other one (`sim`, `mock_vllm` included); the HTTP edge
(the rest of `gateway`) imports none of it, nor `sim` or `mock_vllm`
(tests/test_dependency_direction.py).
"""
