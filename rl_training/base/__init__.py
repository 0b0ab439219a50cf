"""Process-wide basics: dist (every collective, rank-0 printing, metric reductions), errors, exit codes, fault
points, the phase timer, the group (groups.py: a step's rows group by group). May import: nothing of ours. Owns:
the torch.distributed calls, the exit-code table and the map between rows and groups."""
