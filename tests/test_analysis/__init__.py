"""What the analysis tools compute: the cost model, both benchmarks, the
convergence comparison, model statistics, progress lines."""
