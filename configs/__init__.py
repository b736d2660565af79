"""Named configs: `jspec.config.load(NAME)` reads `NAME.yaml` here (installed as jspec.configs)."""
