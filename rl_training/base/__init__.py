"""Process-wide basics: dist (every collective, rank-0 printing, metric reductions), errors, exit codes, fault
points, the phase timer. May import: nothing of ours. Owns: the torch.distributed calls and the exit-code table."""
