"""Configs: frozen dataclasses, loaded from YAML, overridden by dotted `key=value` arguments.

One `Config` describes a run: the model, the mesh it runs on, and what the run does with it. Every
field is validated once, in Python, before anything is traced or compiled, and every error names
the field, the bad value and the fix.
"""

from __future__ import annotations

from jspec.config.errors import ConfigError
from jspec.config.loader import CONFIG_DIR, load, parse_overrides, resolve_path, to_dict
from jspec.config.model import ModelConfig, RopeScaling
from jspec.config.parallel import MeshConfig, PipelineConfig
from jspec.config.rl import RLConfig, TaskConfig
from jspec.config.rollout import (
    Bucket,
    DraftConfig,
    KernelConfig,
    RolloutConfig,
    TreeConfig,
    check_block_tree,
)
from jspec.config.run import Config

__all__ = [
    "Bucket",
    "CONFIG_DIR",
    "Config",
    "ConfigError",
    "DraftConfig",
    "KernelConfig",
    "MeshConfig",
    "ModelConfig",
    "PipelineConfig",
    "RLConfig",
    "RolloutConfig",
    "RopeScaling",
    "TaskConfig",
    "TreeConfig",
    "check_block_tree",
    "load",
    "parse_overrides",
    "resolve_path",
    "to_dict",
]
