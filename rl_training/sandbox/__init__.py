"""Running code outside the trainer's process, in two tiers. Confined, for programs a model wrote: a pool of bubblewrap
sandboxes that run them and return plain values (pool.py; what each sandbox enforces: confinement.py, seccomp_filter.py;
the trusted side's handle on one: handle.py; the process inside: worker.py). Unconfined, for a task's own tools: a
child process that a time limit kills from outside with all it started (tool_process.py, its child tool_worker.py).
Both tiers frame their messages and walk /proc with worker.py's functions; worker.py stays standard-library-only (it
runs inside the sandbox as source). May import: base, config, data. Owns: Pool, PoolSettings, Limits, Job,
ToolProcess, ToolFailed; a task that runs programs or tools owns its Pool or ToolProcess."""
