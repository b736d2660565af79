"""Pipeline parallelism of the policy's training forward: a scanned stage axis (`schedule`), the
tap channel to the draft (`taps`), and the pipelined policy built on them (`model`)."""

from jspec.pipeline.model import PipelinedTransformer, create
from jspec.pipeline.schedule import Schedule, from_stages, to_stages
from jspec.pipeline.taps import TapChannel

__all__ = ["PipelinedTransformer", "Schedule", "TapChannel", "create", "from_stages", "to_stages"]
