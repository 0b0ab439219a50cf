"""The update: micro-batches and packing, the objective's forward and backward, the step guard, the weight-state
guard, the optimizer. May import: base, algs, config, data, policy, probes, rollout. Owns: the optimizer step."""
