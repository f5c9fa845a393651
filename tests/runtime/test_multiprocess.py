"""The scheduled step across 2 processes (jax.distributed over gloo) equals 2 devices in one."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import optax

import jaxsched
from jaxsched.demo import steps
from support.equivalence import build, random_batches
from support import SUPPORT_DIR

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_process_with_two_devices(tmp_path):
    port, out = _free_port(), tmp_path / "params.npz"
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(SUPPORT_DIR / "multiprocess_worker.py"), str(port), str(r), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:  # a dead peer must not hang the suite
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(logs)[-4000:]

    params, apply_fn = build("mlp", 0)
    tx = optax.adam(1e-2)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="dear")
    state = sched.init(params, tx.init(params))
    for x, y in random_batches("mlp", 5, 8, 1):
        state, _ = sched(state, steps.shard_batch((x, y), mesh))
    expected = jax.tree.leaves(sched.finalize(state)[0])
    got = np.load(out)
    assert len(got.files) == len(expected)
    for k, leaf in enumerate(expected):
        np.testing.assert_allclose(got[f"arr_{k}"], np.asarray(leaf), rtol=1e-5, atol=1e-6)
