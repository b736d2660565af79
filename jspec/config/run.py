"""A whole run: the `Config` that holds every section, validated together."""

from __future__ import annotations

import dataclasses

from jspec.config.model import ModelConfig
from jspec.config.parallel import MeshConfig, PipelineConfig
from jspec.config.rl import RLConfig
from jspec.config.rollout import RolloutConfig


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run."""

    name: str = "tiny"
    seed: int = 0
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    rollout: RolloutConfig = RolloutConfig()
    rl: RLConfig | None = None
    pipeline: PipelineConfig = PipelineConfig()

    def validate(self) -> Config:
        self.model.validate("model")
        self.rollout.validate(self.model)
        self.pipeline.validate(self.model, self.mesh)
        if self.rl is not None:
            self.rl.validate()
            self.pipeline.check_rows(self.rl.batch // self.rl.sequences_per_row)
        return self
