"""A whole run: the `Config` that holds every section, validated together."""

from __future__ import annotations

import dataclasses

from jspec.config.errors import ConfigError
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
            rl, per_row = self.rl, self.rl.sequences_per_row
            if self.model.vocab_size % rl.vocab_chunks:
                raise ConfigError(
                    f"rl.vocab_chunks={rl.vocab_chunks} does not divide the vocabulary of "
                    f"{self.model.vocab_size} ids (model.vocab_size); pick a divisor of it."
                )
            # A step's training rows (whole or packed) and the warm start's, each cut into the
            # pipeline's microbatches.
            for rows in sorted({rl.batch // per_row, rl.sft_batch // per_row, *rl.packed_rows}):
                self.pipeline.check_rows(rows)
        return self
