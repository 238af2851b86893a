"""The command lines end to end, the converters, the tools' usage errors,
the docs and ``make install``."""
