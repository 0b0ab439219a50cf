"""The code-execution sandbox: a pool of bubblewrap sandboxes that run untrusted programs and return plain values.
May import: nothing of rl_training (a leaf below tasks). Owns: pool.py (Pool, PoolSettings, Limits, Job), worker.py
(the process inside, and the codec both ends share), seccomp_filter.py; a task that runs programs owns a Pool."""
