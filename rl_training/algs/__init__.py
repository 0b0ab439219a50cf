"""The math of the objective: advantages, surrogate objectives, off-policy corrections and losses, as pure functions
(docs/objectives.md). May import: base. Owns: every loss formula; no config objects, no collectives, no logging."""
