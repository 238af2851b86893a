"""The command-line tools, the cost model, emulated nodes and the docs."""
