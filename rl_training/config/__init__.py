"""The one config tree: the schema (every key with its doc and bounds), loading with dotted overrides, resolution into
frozen derived values, the generated reference (docs/config.md). May import: base, algs. Owns: Config, ConfigError
and the name-or-`file.py:NAME` loader of every extension point."""
