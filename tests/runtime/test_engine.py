"""The xla engine: per-function compiler options, and lowering for GPU and TPU from a CPU host."""

import jax
import optax
import pytest

import jaxsched
from jaxsched.demo import steps
from jaxsched.runtime.engine._xla import GPU_OPTIONS, compiler_options_for
from support.equivalence import build, random_batches


def _scheduled(strategy, compiler_options=None, devices=2):
    params, apply_fn = build("mlp", 0)
    tx = optax.adam(1e-2)
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy=strategy, compiler_options=compiler_options)
    state = sched.init(params, tx.init(params))
    batch = steps.shard_batch(next(random_batches("mlp", 1, 2 * devices, 0)), mesh)
    return sched, state, batch


@pytest.mark.slow
def test_gpu_option_set_is_accepted_by_xla_and_cpu_gets_none():
    assert compiler_options_for("cpu") == {}
    assert compiler_options_for("cuda") == GPU_OPTIONS
    capped = compiler_options_for("gpu", bucket_bytes=8_000_000, axis_size=8)
    assert capped["xla_gpu_all_reduce_combine_threshold_bytes"] == 8_000_000
    assert capped["xla_gpu_all_gather_combine_threshold_bytes"] == 8_000_000
    # XLA sizes a reduce-scatter by its result: one device's shard of the bucket
    assert capped["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 1_000_000
    sched, state, batch = _scheduled("dear", compiler_options=dict(GPU_OPTIONS))
    state, aux = sched(state, batch)  # compiles with the GPU option names on the CPU client
    assert float(aux["loss"]) > 0


def test_a_misspelled_option_fails_at_compile_time():
    sched, state, batch = _scheduled("wfbp", compiler_options={"xla_gpu_enable_latency_hiding_schedular": True})
    with pytest.raises(Exception, match="No such compile option"):
        sched(state, batch)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_scheduled_step_lowers_for_accelerators(strategy, platform):
    sched, state, batch = _scheduled(strategy)
    sched.lower(state, batch)  # traces and builds the program for this CPU mesh
    program = sched.program
    inputs = program.inputs(state, batch)
    lowered = program.core.trace(*inputs).lower(lowering_platforms=(platform,))
    text = lowered.as_text()
    expected = "reduce_scatter" if strategy == "dear" else "all_reduce"
    assert expected in text
