"""Records from files and datasets: Example and the readers (a bad record is a one-line DataError), prompts and the
sampler, gold episodes for SFT. May import: base. Owns: the Example every task parses a record into."""
