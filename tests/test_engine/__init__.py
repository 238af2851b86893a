"""The MMEngine adapters in real Runners: the runner hook, hook state
files, checkpoints, FSDP2."""
