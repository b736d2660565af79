"""How a run is spread over devices: the mesh's axis sizes and the pipeline's stages."""

from __future__ import annotations

import dataclasses

from jspec.config.errors import ConfigError
from jspec.config.model import ModelConfig


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; -1 on one axis means 'all devices left over'."""

    data: int = -1
    stage: int = 1
    context: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism of the policy's training forward (`jspec.pipeline`): the layers cut in
    `stages` stages, one per rank of mesh axis `stage`, each stage holding `repeats` chunks of
    consecutive layers (circular schedule: more repeats, smaller bubble), the batch cut in
    `microbatches`. stages=1 is no pipeline."""

    stages: int = 1
    microbatches: int = 1
    repeats: int = 1

    def validate(self, model: ModelConfig, mesh: MeshConfig, where: str = "pipeline") -> None:
        for name in ("stages", "microbatches", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name}={getattr(self, name)} must be >= 1.")
        if mesh.stage not in (-1, self.stages):
            raise ConfigError(
                f"mesh.stage={mesh.stage} but {where}.stages={self.stages}: each rank of the stage "
                f"axis runs one stage; set mesh.stage={self.stages} or {where}.stages={mesh.stage}."
            )
        chunks = self.stages * self.repeats
        if model.num_layers % chunks:
            raise ConfigError(
                f"model.num_layers={model.num_layers} is not divisible by {where}.stages * "
                f"{where}.repeats = {self.stages} * {self.repeats}; choose stages and repeats "
                f"whose product divides {model.num_layers}."
            )
        if self.repeats > 1 and self.microbatches < self.stages:
            raise ConfigError(
                f"{where}.microbatches={self.microbatches} < {where}.stages={self.stages}: with "
                f"{where}.repeats={self.repeats} a microbatch re-enters stage 0 before the next "
                f"has left it; use at least {self.stages} microbatches or repeats=1."
            )
        if self.stages > 1 and model.num_experts > 0:
            raise ConfigError(
                f"{where}.stages={self.stages} with model.num_experts={model.num_experts}: the "
                "pipeline runs dense models only; set pipeline.stages=1 for a mixture of experts."
            )

    def check_rows(self, rows: int, where: str = "pipeline") -> None:
        """Raises ConfigError unless `rows` training rows cut into the microbatches."""
        if rows % self.microbatches:
            raise ConfigError(
                f"{rows} training rows do not cut into {where}.microbatches={self.microbatches}; "
                f"choose a divisor of {rows} (each microbatch must also split over mesh.data)."
            )
