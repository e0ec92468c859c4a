"""The deployment config: one schema for the gateway, the simulator and the mock backends.

    catalog    config/models.yaml + config/hardware.yaml -> `router.profiles.Catalog`
    outlier    the ``outlier_detection:`` section (Envoy's outlier detection), the health thresholds' defaults
    settings   the fleet YAML -> frozen, validated `Settings` (strict: errors name the key's path);
               `Settings.backend_spec` -> the router's `router.cost.BackendSpec` of a backend
    errors     ConfigError

Every reader of a fleet file goes through `load_settings` / `parse_settings`: the gateway
(its command line and workers, then `gateway.lifespan`), the simulator
(`sim.fleet.fleet_from_settings`) and the mocks (`mock_vllm.app_factory.build_backend_app`), so a
backend field means the same everywhere. The config's defaults are defined here or imported from
the module that owns them (the index's from `prefix_index`). Importing the package reads no file
and no environment variable, and loads no Redis client: `load_settings` reads them when called.
"""

from fleet_config.catalog import CONFIG_DIR, default_catalog, load_catalog
from fleet_config.errors import ConfigError
from fleet_config.outlier import OutlierDetectionSection
from fleet_config.settings import (
    BackendEntry,
    GatewaySection,
    IndexSection,
    KvPoolSection,
    RoutingSection,
    Settings,
    load_settings,
    parse_settings,
)

__all__ = [
    "CONFIG_DIR",
    "BackendEntry",
    "ConfigError",
    "GatewaySection",
    "IndexSection",
    "KvPoolSection",
    "OutlierDetectionSection",
    "RoutingSection",
    "Settings",
    "default_catalog",
    "load_catalog",
    "load_settings",
    "parse_settings",
]
