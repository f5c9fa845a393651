"""Profilers: fits, measured layer and network profiles, and the profile -> simulate path."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import optax
import pytest

from jaxsched.zoo import models
from jaxsched.tools.cli import main
from jaxsched.sim._costmodel import LayerProfile, NetworkProfile
from jaxsched.plan._profiling import fit_alpha_beta, profile_network, profile_zoo_model


def test_fit_recovers_alpha_beta_and_keeps_alpha_nonnegative():
    sizes = [1e3, 1e4, 1e5, 1e6]
    cost, error = fit_alpha_beta(sizes, [2e-4 + 3e-9 * b for b in sizes])
    assert cost.alpha_s == pytest.approx(2e-4) and cost.beta_s_per_byte == pytest.approx(3e-9)
    assert error < 1e-9
    cost, error = fit_alpha_beta(sizes, [1e-9 * b - 1e-6 * (b > 5e5) for b in sizes])
    assert cost.alpha_s >= 0 and cost.beta_s_per_byte > 0 and error > 0


@pytest.mark.parametrize(
    "name", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)]
)  # the heaviest compiles run in `make test-slow` (CI runs both)
def test_layer_profile_of_zoo_model(name):
    prof = profile_zoo_model(name, batch=8, repeats=2)
    shape, outputs = ((32,), 64) if name == "transformer" else ((8, 8, 1), 10)
    params, _ = models.pure(models.build(name, shape, outputs))
    assert prof.total_params == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    assert prof.total_bytes == 4 * prof.total_params
    assert all(l.forward_s > 0 and l.backward_s > 0 for l in prof.layers)
    assert LayerProfile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof


def test_network_profile_on_virtual_mesh():
    # Sizes far apart (4 KiB .. 8 MiB) so that load from other tests cannot flatten the fit.
    net, errors = profile_network(sizes=(1 << 12, 1 << 18, 1 << 23), repeats=5)
    assert net.workers == jax.device_count() == 8
    assert set(net.collectives) == set(errors) == {"all_reduce", "reduce_scatter", "all_gather", "ppermute"}
    for name, cost in net.collectives.items():
        assert cost.alpha_s >= 0 and cost.beta_s_per_byte >= 0
        assert math.isfinite(errors[name])
    assert net.time("all_reduce", 1 << 23) > net.time("all_reduce", 1 << 12)
    assert net.dispatch_s > 0 and net.copy_s_per_byte > 0


def test_update_is_measured_and_scales_with_parameter_count():
    import optax

    from jaxsched.plan._profiling import measure_dispatch, profile_update

    mesh = jax.make_mesh((8,), ("data",))
    small, big = {"w": np.ones((1 << 12,), np.float32)}, {"w": np.ones((1 << 20,), np.float32)}
    dispatch = measure_dispatch(mesh)
    assert dispatch > 0
    seconds = profile_update([small, big, {}], optax.sgd(0.1, momentum=0.9), mesh, repeats=5, dispatch_s=dispatch)
    assert seconds[1] > 0 and seconds[2] == 0
    assert seconds[1] > 4 * seconds[0]  # 256x the parameters; the update is memory-bound


def test_profile_cli_output_feeds_simulate(tmp_path, capsys):
    # Output folders that do not exist yet are created.
    layers, network = tmp_path / "profiles" / "l.json", tmp_path / "net" / "deeper" / "n.json"
    out = tmp_path / "results" / "o.json"
    assert (
        main(
            [
                "profile",
                "--model",
                "mlp",
                "--batch",
                "8",
                "--repeats",
                "2",
                "--out",
                str(layers),
                "--network-out",
                str(network),
                "--optimizer",
                "adam",
                "--no-progress",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "fit error" in printed and "update" in printed
    assert all(layer.update_s >= 0 for layer in LayerProfile.load(layers).layers)
    assert NetworkProfile.load(network).workers == 8
    assert (
        main(
            [
                "simulate",
                "--profile",
                str(layers),
                "--network-profile",
                str(network),
                "--strategies",
                "allreduce,wfbp,dear",
                "--planner",
                "optimal",
                "--json",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    # One bucket is among the partitions the optimal planner considers, so WFBP cannot lose
    # by more than packing and unpacking its bucket buffers (which the allreduce step skips).
    net = NetworkProfile.load(network)
    copies = 2 * net.copy_s_per_byte * LayerProfile.load(layers).total_bytes
    limit = data["strategies"]["allreduce"]["iteration_s"] + copies
    assert data["strategies"]["wfbp"]["iteration_s"] <= limit * (1 + 1e-9)  # equal up to rounding


def test_layer_profile_on_the_mesh_is_rescaled_to_the_whole_model():
    mesh = jax.make_mesh((8,), ("data",))
    prof = profile_zoo_model("mlp", batch=4, repeats=2, mesh=mesh, optimizer=optax.sgd(0.1))
    assert prof.meta["workers"] == 8
    # A 25k-parameter SGD update is within the dispatch noise here: it may floor at zero.
    # (test_update_is_measured_and_scales_with_parameter_count checks the measurement.)
    assert all(layer.update_s >= 0 for layer in prof.layers) and prof.meta["dispatch_s"] > 0
    assert prof.forward_s == pytest.approx(prof.meta["whole_model_forward_s"])
    assert prof.backward_s == pytest.approx(prof.meta["whole_model_backward_s"])
    assert [l.name for l in prof.layers] == ["hidden/0", "hidden/1", "head"]


MULTI_PROCESS_SCRIPT = """
import json, sys
import jax
process_id, port = int(sys.argv[1]), sys.argv[2]
jax.config.update("jax_num_cpu_devices", 1)
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=process_id)
from jaxsched.plan._profiling import profile_network
net, errors = profile_network(sizes=(1 << 12, 1 << 16, 1 << 20), repeats=2)
print(json.dumps({"processes": jax.process_count(), "errors": errors, "net": net.to_dict()}))
"""


@pytest.mark.slow
def test_network_profile_across_two_processes(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    script = tmp_path / "worker.py"
    script.write_text(MULTI_PROCESS_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-2000:]
    result = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert result["processes"] == 2
    net = NetworkProfile.from_dict(result["net"])
    assert net.workers == 2 and net.meta["processes"] == 2
    assert all(math.isfinite(e) for e in result["errors"].values())
