"""The communication core: config checks, the registry and records,
telemetry, accuracy classes, ``auto``."""
