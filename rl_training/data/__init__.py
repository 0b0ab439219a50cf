"""Records from files and datasets: Example and the readers (a bad record is a one-line DataError), prompts and the
sampler, gold episodes for SFT; text made safe to tokenize (text.py: encode_plain, a tool's value as text) and the
chat template's token layout of an appended turn (chat_turns.py). May import: base. Owns: the Example every task
parses a record into."""
