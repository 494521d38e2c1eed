"""Typed service config: schema, YAML loading, environment overrides."""

from kvstore.config.loader import ConfigError, load_config, parse_config
from kvstore.config.schema import (
    DaemonConfig,
    DiskConfig,
    FileConfig,
    GPUConfig,
    HostConfig,
    KVStoreConfig,
    LoggingConfig,
    MetricsConfig,
    ModelConfig,
    PolicyConfig,
)

__all__ = [
    "ConfigError",
    "DaemonConfig",
    "DiskConfig",
    "FileConfig",
    "GPUConfig",
    "HostConfig",
    "KVStoreConfig",
    "LoggingConfig",
    "MetricsConfig",
    "ModelConfig",
    "PolicyConfig",
    "load_config",
    "parse_config",
]
