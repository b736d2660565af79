"""The pipelined policy: `jspec.models.Transformer` whose training forward runs as a pipeline.

It is a Transformer in every other respect (embedding, final norm, logits, context parallelism,
taps, prefill / decode / verify), so the co-training train step (`jspec.rl.train`) and the sampler
take it unchanged. Only the dense layer stack differs: its weights are stage weights [S, R * P,
...] (`jspec.pipeline.schedule`), sharded over mesh axis `stage`, and the training forward runs
them through `schedule.run`, with the taps on a `TapChannel`. Rollouts step through the layers in
layer order: the stage weights are put back in layer order inside `jit` (a reshard over the stage
axis, never through the host), as the sampler's unrolled layers want.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jspec import mesh as mesh_lib
from jspec.config import MeshConfig, ModelConfig, PipelineConfig
from jspec.models.layers import remat_layer
from jspec.models.transformer import TRAIN_ACT, Transformer, create_sharded
from jspec.pipeline import schedule as sched
from jspec.pipeline.taps import TapChannel

ACT = (*TRAIN_ACT, "act_embed")  # logical axes of a microbatch's residual stream


class PipelinedTransformer(Transformer):
    """A Transformer whose layers are cut into `pipeline.stages` stages (module docstring).

    Its initial values equal `Transformer`'s of the same seed, in stage order (`to_stages`)."""

    def __init__(
        self, config: ModelConfig, pipeline: PipelineConfig, *, rngs: nnx.Rngs, mesh: Mesh
    ):
        stage = 1 if mesh is None else mesh.shape[sched.STAGE]
        pipeline.validate(config, MeshConfig(stage=stage))
        self.schedule = sched.Schedule.of(pipeline, config.num_layers)
        super().__init__(config, rngs=rngs, mesh=mesh)
        for name, var in list(vars(self.layers).items()):
            if isinstance(var, nnx.Param):
                value = sched.to_stages(var[...], self.schedule)
                setattr(self.layers, name, nnx.Param(value, axes=(sched.STAGE, *var.axes)))

    def _scan(self, x_BTD, cos_sin, attend, segment_ids, positions, taps: bool):
        """The layers as a pipeline over microbatches; the taps over a `TapChannel`."""
        s = self.schedule
        channel = TapChannel(self.config.taps, s) if taps else None
        graphdef, weights = nnx.split(self.layers)
        micro = lambda x: sched.to_microbatches(x, s.microbatches)
        inputs = jax.tree.map(micro, (segment_ids, positions, cos_sin))

        def stage_fn(w, x, mb, repeat, stage):
            seg, pos, cs = mb
            layer_attend = lambda q, k, v: attend(q, k, v, seg, pos)
            p = s.layers_per_chunk
            chunk = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, repeat * p, p), w)
            first = s.chunk_start(repeat, stage)

            def body(carry, j_w):
                (x, slots), (j, w_j) = carry, j_w
                if channel is not None:
                    slots = channel.record(slots, x, stage, first + j)
                x = self._constrain(x, ACT)
                x, _, _ = nnx.merge(graphdef, w_j)(x, cs, layer_attend, TRAIN_ACT, seg != 0)
                return (x, slots), None

            slots = None if channel is None else channel.empty_slots(x)
            body = remat_layer(body, self.config.remat)
            (x, slots), _ = jax.lax.scan(body, (x, slots), (jnp.arange(p), chunk))
            return x, slots

        x_MBTD = self._constrain(micro(x_BTD), (None, *ACT))
        out, tapped = sched.run(stage_fn, weights, x_MBTD, inputs, s, self.mesh, ACT, channel)
        out_BTD = self._constrain(sched.from_microbatches(out), ACT)
        taps_ = [] if channel is None else [sched.from_microbatches(t) for t in tapped]
        return out_BTD, taps_, None

    def _stacks(self) -> dict[str, tuple[nnx.GraphDef, nnx.State]]:
        """The layer stack in layer order (for the unrolled rollout layers), placed by the
        parameters' rules without the stage axis."""
        graphdef, state = nnx.split(self.layers)
        unstage = lambda var: var.replace(
            mesh_lib.constrain(sched.from_stages(var[...], self.schedule), self.mesh, var.axes[1:])
        )
        state = jax.tree.map(unstage, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        return {"layers": (graphdef, state)}


def create(
    config: ModelConfig, pipeline: PipelineConfig, *, mesh: Mesh, seed: int = 0
) -> PipelinedTransformer:
    """A randomly initialised pipelined policy, born sharded over `mesh` (stage weights over the
    `stage` axis); its values are `jspec.models.create(config, seed=seed)`'s, in stage order."""
    make = lambda: PipelinedTransformer(config, pipeline, rngs=nnx.Rngs(seed), mesh=mesh)
    return create_sharded(make, mesh)
