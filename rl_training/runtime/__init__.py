"""A command's process: the command line, the run lock, the lifeline, stop signals, the platform check, seeding and
thread counts. May import: base, config. Owns: what a runner does before and around its run, not the run."""
