"""Sharding over a device mesh: the mesh of a config, shardings from logical axes, sharded train state and steps,
and multi-process start-up. `pipeline` is the layer stack's GPipe schedule over the mesh's pipeline axis."""

from ltm_jax.parallel.layout import Layout, Sharded, abstract_state, init_state, make_layout, sharded_if_multi_device
from ltm_jax.parallel.distributed import initialize, is_main_process
from ltm_jax.parallel.mesh import activate, make_mesh, resolve_sizes, rules
from ltm_jax.layers import pipeline
from ltm_jax.parallel.sharding import (batch_sharding, param_shardings, param_specs, process_rows, put_batch,
                                       replicated, state_shardings)
