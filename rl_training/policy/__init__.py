"""The model being trained: base model + LoRA build, merged HF weights for an engine, the tiny test model.
May import: base. Owns: model construction and weight export; no training step."""
