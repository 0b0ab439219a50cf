"""Gradient noise scale and effective sample size: capture hooks, the estimators (gns.py, ess.py, anova.py, advisor.py,
lora_health.py: pure), the step's bookkeeping (probe.py; budget.py feeds the nested ANOVA and the rollout-budget
advisor), the guard and the dashboard. May import: base, algs. Owns: the probe/* and lora/* metrics."""
