"""Step and episode metrics, the logger (TensorBoard, a null object off rank 0), samples, W&B, progress. May import:
base, algs, config, ckpt, tasks, probes, rollout, train. Owns: the metric names and where each is written."""
