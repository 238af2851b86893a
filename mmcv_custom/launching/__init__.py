"""Starting a run: what happens before and around training itself.

The process group's start-up on CPUs, the torchrun wrapper, the checks that
name every problem before any work (preflight), where a run starts, the work
dir's lock, the console the tools print, and emulated nodes. Modules here may
import the packages below them (hooks, comm, integrity, engine); nothing
below imports this package, and this file imports nothing, so a module here
can be run or imported alone.
"""
