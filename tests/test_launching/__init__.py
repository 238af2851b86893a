"""Starting a run: the CPU start-up, torchrun and Slurm launchers,
restarts, where a run starts, the work dir lock, the preflight, the
console, emulated nodes."""
