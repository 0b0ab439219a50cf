"""SLURM: the per-node launcher (`python -m rl_training.cluster.launch` under srun) and the per-node vLLM servers.
May import: base, config, retrieval. Never tasks: it starts a retrieval server as a process and probes it over
HTTP. Owns: the node-level processes of a job."""
