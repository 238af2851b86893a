"""The communication core: hook math on real gloo ranks, the registry,
config checks, records, the comm worker, PowerSGD and int8."""
