"""Each host's share of a global batch, under JAX's multi-controller runtime.

With many processes (`jax.distributed`), every process runs the same program but holds only the
devices of its own host, so no host may build or read a whole global batch: each builds the rows
whose shards its devices hold (`local_rows`), turns them into one global array
(`global_array`), and reads back only its own rows of a result (`host_rows`). Small per-row
values that every host needs, such as rewards for a metric, travel through `gather` (rows that
several hosts hold, where the data axis is smaller than the host count, counted once). With one
process these are plain `device_put` and `np.asarray`, so the same code runs on a laptop and a
pod.

Rows are the leading axis. A mesh built from `jax.devices()` in order holds each process's
devices together, so a process's rows are one contiguous block; a layout that splits them is an
error naming the rows.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding


def local_rows(sharding: Sharding, rows: int) -> slice:
    """The rows of a `rows`-row global batch whose shards this process's devices hold."""
    index = sharding.addressable_devices_indices_map((rows,))
    held = sorted({i for idx in index.values() for i in range(rows)[idx[0]]})
    if held != list(range(held[0], held[-1] + 1)):
        raise ValueError(
            f"process {jax.process_index()} holds rows {held} of {rows}, not one block; build the "
            "mesh from jax.devices() in order (jspec.mesh.make_mesh) so each host's devices are "
            "adjacent."
        )
    return slice(held[0], held[-1] + 1)


def global_array(sharding: Sharding, local, rows: int) -> jax.Array:
    """One global array of `rows` rows from this process's block of them (`local`, numpy)."""
    local = np.asarray(local)
    return jax.make_array_from_process_local_data(sharding, local, (rows, *local.shape[1:]))


def global_tree(sharding: Sharding, local_tree, rows: int):
    """`global_array` of every leaf of a pytree of row-major numpy arrays."""
    return jax.tree.map(lambda x: global_array(sharding, x, rows), local_tree)


def host_rows(x: jax.Array, rows: slice) -> np.ndarray:
    """Rows `rows` of global array `x`, read from this process's own shards only."""
    out = np.empty((rows.stop - rows.start, *x.shape[1:]), x.dtype)
    filled = np.zeros(rows.stop - rows.start, bool)
    for shard in x.addressable_shards:
        start, stop, _ = shard.index[0].indices(x.shape[0])
        lo, hi = max(start, rows.start), min(stop, rows.stop)
        if lo < hi:
            out[lo - rows.start : hi - rows.start] = np.asarray(shard.data)[lo - start : hi - start]
            filled[lo - rows.start : hi - rows.start] = True
    if not filled.all():
        missing = np.flatnonzero(~filled) + rows.start
        raise ValueError(
            f"process {jax.process_index()} does not hold rows {missing.tolist()} of an array "
            f"sharded {x.sharding}; read the rows `local_rows` gives for that sharding."
        )
    return out


def gather(local, rows: slice | None = None) -> np.ndarray:
    """Every process's `local` rows (numpy, 1-d or more), concatenated in process order, on every
    process. With `rows`, the block of a batch's rows `local` belongs to (`local_rows`; the same
    shape on every process), in row order and each block once: a mesh whose data axis is smaller
    than the process count gives several processes the same rows."""
    local = np.atleast_1d(np.asarray(local))
    if jax.process_count() == 1:
        return local
    if rows is None:
        return np.asarray(multihost_utils.process_allgather(local, tiled=True))
    bounds = np.asarray(multihost_utils.process_allgather(np.array([rows.start, rows.stop])))
    each = np.asarray(multihost_utils.process_allgather(local))  # [process, ...]
    starts, first = np.unique(bounds[:, 0], return_index=True)
    stops = bounds[first, 1]
    if starts[0] != 0 or np.any(stops[:-1] != starts[1:]):
        raise ValueError(
            f"the processes hold row blocks {bounds.tolist()}, which do not split the rows into "
            "disjoint blocks; build the mesh from jax.devices() in order (jspec.mesh.make_mesh)."
        )
    return np.concatenate(each[first])


def gather_global(x):
    """A small global array (or pytree of them) whole on every process, as numpy."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, x)
    return multihost_utils.process_allgather(x, tiled=True)


def is_main() -> bool:
    """Whether this is process 0: the one that writes metrics, plots and logs."""
    return jax.process_index() == 0
