"""The example trainers in examples/: they run, validate options first, resume exactly,
survive Ctrl-C with a loadable checkpoint, and run across processes.

The fast tests call each trainer's ``main(argv)`` in this process (8 virtual CPU devices
from conftest.py) on tiny configs; the slow ones start real processes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = {  # a few seconds each: small models, 2 devices
    "digits": '[model]\nname = "mlp"\nhidden = [32]\n[data]\nname = "digits"\nbatch_size = 32\n'
    '[optimizer]\nname = "adam"\nlearning_rate = 3e-3\n[train]\nsteps = 4\ndevices = 2\n',
    "cifar_synthetic": '[model]\nname = "cnn"\nchannels = 4\nblocks = 1\n[data]\n'
    'name = "synthetic_cifar"\nbatch_size = 8\nn = 64\n[train]\nsteps = 3\n'
    "devices = 2\n",
    "tiny_lm": '[model]\nname = "transformer"\ndim = 16\nheads = 2\nlayers = 1\n[data]\n'
    'name = "synthetic_tokens"\nbatch_size = 8\nn = 64\nseq_len = 8\nvocab_size = 16\n'
    "[train]\nsteps = 3\ndevices = 2\n",
}
TINY["trainstate_digits"] = TINY["digits"]


def _tiny(tmp_path: Path, name: str) -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(TINY[name])
    return str(path)


def _run(name: str, tmp_path: Path, *args: str, out: str = "out") -> dict:
    code = _load(name).main(["--config", _tiny(tmp_path, name), "--out", str(tmp_path / out), "--no-progress", *args])
    assert code == 0
    return json.loads((tmp_path / out / "summary.json").read_text())


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# Scheduled strategies whose programs compile quickly here; tiny_lm's dear and wfbp
# programs take longer to compile and run in the slow README test.
RUNS = {
    "digits": ["--strategy", "dear", "--compression", "topk:0.1", "--buckets", "hidden;head"],
    "cifar_synthetic": ["--strategy", "wfbp", "--buckets", "2000"],
    "tiny_lm": ["--strategy", "allreduce"],
    "trainstate_digits": ["--strategy", "wfbp", "--buckets", "params/Dense_0;params/Dense_1"],
}


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> Path:
    """One short digits run, shared by the tests that read it or refuse to overwrite it."""
    tmp = tmp_path_factory.mktemp("digits")
    _run("digits", tmp, *RUNS["digits"], "--checkpoint-every", "2")
    return tmp


@pytest.mark.parametrize(
    "name",
    [
        "digits",
        pytest.param("cifar_synthetic", marks=pytest.mark.slow),
        pytest.param("tiny_lm", marks=pytest.mark.slow),
        pytest.param("trainstate_digits", marks=pytest.mark.slow),
    ],
)
def test_each_trainer_runs_and_writes_metrics_summary_plot_and_checkpoints(request, tmp_path, name):
    if name == "digits":
        tmp_path = request.getfixturevalue("digits_run")
    else:
        _run(name, tmp_path, *RUNS[name], "--checkpoint-every", "2")
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(summary["steps"]))
    unit = "tokens_per_s" if name == "tiny_lm" else "images_per_s"
    assert all(np.isfinite(r["loss"]) and r[unit] > 0 for r in rows)
    assert summary["strategy"] == RUNS[name][1] and summary[unit] > 0
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] == summary["steps"] and 2 in steps
    if name == "digits":
        assert summary["buckets_used"] == 2 and summary["compression"].startswith("TopK")
    if name == "trainstate_digits":
        assert summary["buckets_used"] == 2 and summary["trained_steps"] == summary["steps"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--strategy", "dearr"], "argument --strategy: invalid choice: 'dearr'"),
        (["--strategy", "allreduce", "--compression", "topk:0.01"], "cannot carry TopK"),
        (["--strategy", "dear", "--compression", "powersgd:2"], "use --strategy wfbp"),
        (["--compression", "zip"], "--compression 'zip': use one of"),
        (["--engine", "gpu"], "argument --engine: 'gpu' is unknown"),
        (["--devices", "3"], "not divisible by --devices 3"),
        (["--buckets", "hidden;;head"], "has an empty bucket"),
        (["--config", "nope.toml"], "config file 'nope.toml' does not exist"),
    ],
)
def test_bad_options_fail_at_once_naming_the_option(tmp_path, capsys, args, message):
    started = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        _load("digits").main(["--out", str(tmp_path / "out"), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # no work started
    assert time.perf_counter() - started < 5


def test_an_unknown_bucket_path_is_named_before_training(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _run("digits", tmp_path, "--buckets", "hid;head")
    assert exit_info.value.code == 2
    assert "--buckets: buckets[0] names unknown parameter 'hid'" in capsys.readouterr().err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_second_run_into_the_same_folder_needs_resume_and_the_same_settings(digits_run, capsys):
    for args, message in (
        (["--steps", "6"], "pass --resume"),
        (["--resume", "--seed", "3"], "seed was 0, now 3"),
        (["--resume", "--strategy", "wfbp"], "strategy was 'dear', now 'wfbp'"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            _load("digits").main(
                ["--config", _tiny(digits_run, "digits"), "--out", str(digits_run / "out"), *RUNS["digits"], *args]
            )
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_digits_dear_reaches_the_same_accuracy_as_allreduce(tmp_path):
    """Same seed, same batches: the scheduled step differs from the plain one by rounding."""
    config = ROOT / "configs" / "mlp_digits.toml"
    digits = _load("digits")
    summaries = {}
    for strategy in ("allreduce", "dear"):
        out = tmp_path / strategy
        assert (
            digits.main(
                ["--config", str(config), "--strategy", strategy, "--steps", "100", "--out", str(out), "--no-progress"]
            )
            == 0
        )
        summaries[strategy] = json.loads((out / "summary.json").read_text())
    plain, dear = summaries["allreduce"], summaries["dear"]
    assert plain["test_accuracy"] > 0.9
    assert abs(dear["test_accuracy"] - plain["test_accuracy"]) <= 1 / 359  # one test image
    assert dear["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-4)


@pytest.mark.slow
def test_trainstate_digits_learns_and_resumes_exactly(tmp_path):
    """The Flax linen + TrainState trainer: dear beats chance (10%) clearly, and 40 steps,
    resume, 40 more give the losses of 80 straight steps."""
    config = str(ROOT / "configs" / "mlp_digits.toml")
    trainer = _load("trainstate_digits")
    common = ["--config", config, "--strategy", "dear", "--no-progress", "--checkpoint-every", "40"]
    assert trainer.main([*common, "--steps", "80", "--out", str(tmp_path / "straight")]) == 0
    summary = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.8 and summary["trained_steps"] == 80
    assert trainer.main([*common, "--steps", "40", "--out", str(tmp_path / "resumed")]) == 0
    assert trainer.main([*common, "--steps", "80", "--resume", "--out", str(tmp_path / "resumed")]) == 0
    resumed = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert resumed["resumed_from"] == 40 and resumed["trained_steps"] == 80
    losses = lambda run: [r["loss"] for r in _rows(tmp_path / run / "metrics.jsonl")]
    assert losses("resumed") == losses("straight")
    assert resumed["test_accuracy"] == summary["test_accuracy"]


def _state(out: Path, step: int):
    from jaxsched.integrations.checkpoint import Checkpoints

    with Checkpoints(out / "checkpoints") as checkpoints:
        return checkpoints.restore(None, step)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, extra", [("dear", []), ("allreduce", []), ("wfbp", ["--compression", "topk:0.05"])])
def test_train_10_save_restore_train_10_equals_train_20(tmp_path, strategy, extra):
    args = ["--strategy", strategy, "--checkpoint-every", "10", *extra]
    _run("digits", tmp_path, *args, "--steps", "10", out="split")
    resumed = _run("digits", tmp_path, *args, "--steps", "20", "--resume", out="split")
    straight = _run("digits", tmp_path, *args, "--steps", "20", out="straight")
    assert resumed["resumed_from"] == 10
    a = _rows(tmp_path / "split" / "metrics.jsonl")
    b = _rows(tmp_path / "straight" / "metrics.jsonl")
    assert [r["step"] for r in a] == list(range(20))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    split, straight_state = _state(tmp_path / "split", 20), _state(tmp_path / "straight", 20)
    assert len(jax.tree.leaves(split)) == len(jax.tree.leaves(straight_state)) > 0
    for x, y in zip(jax.tree.leaves(split), jax.tree.leaves(straight_state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert resumed["test_accuracy"] == straight["test_accuracy"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's jaxsched
    return env


@pytest.mark.slow
def test_sigint_leaves_the_last_complete_checkpoint_loadable(tmp_path):
    out = tmp_path / "out"
    config = tmp_path / "digits.toml"
    config.write_text(TINY["digits"])
    proc = subprocess.Popen(
        [
            sys.executable,
            str(EXAMPLES / "digits.py"),
            "--config",
            str(config),
            "--steps",
            "100000",
            "--checkpoint-every",
            "5",
            "--out",
            str(out),
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "10").is_dir():  # a complete one, and saving goes on
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "continue with --resume" in stdout
    latest = max(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert latest >= 10 and f"last complete checkpoint: step {latest}" in stdout
    # Loadable into the scheduled layout, and the run continues from it.
    digits = _load("digits")
    assert (
        digits.main(
            ["--config", str(config), "--steps", str(latest + 2), "--resume", "--out", str(out), "--no-progress"]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] == latest
    assert [r["step"] for r in _rows(out / "metrics.jsonl")] == list(range(latest + 2))


@pytest.mark.slow
def test_two_processes_under_jaxsched_launch_resume_and_match_one_process(tmp_path):
    """Each process feeds its own rows of every batch; the host engine runs the collectives;
    3 steps, then 3 more resumed from the checkpoint, match 6 steps on 2 devices in one."""
    config = tmp_path / "digits.toml"
    config.write_text(TINY["digits"])

    def launch(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxsched",
                "launch",
                "--hosts",
                "2",
                "--cpu-devices",
                "2",
                "--timeout",
                "300",
                "--",
                sys.executable,
                str(EXAMPLES / "digits.py"),
                "--config",
                str(config),
                "--out",
                str(tmp_path / "two"),
                *args,
            ],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=360,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return done

    first = launch("--steps", "3")
    # Not a terminal: plain progress lines with throughput, from process 0 only, no redraws.
    assert re.search(r"^\[0\] digits: 2/3 \[loss=[\d.]+, images/s=[\d,]+\]$", first.stderr, re.M)
    assert "\r" not in first.stderr and "[1] digits:" not in first.stderr
    launch("--steps", "6", "--resume")
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["processes"] == 2 and two["devices"] == 2 and two["engine_used"] == "host"
    assert two["resumed_from"] == 3
    one = _run("digits", tmp_path, "--steps", "6", "--devices", "2", out="one")
    np.testing.assert_allclose(
        [r["loss"] for r in _rows(tmp_path / "two" / "metrics.jsonl")],
        [r["loss"] for r in _rows(tmp_path / "one" / "metrics.jsonl")],
        rtol=1e-5,
    )
    assert two["test_accuracy"] == pytest.approx(one["test_accuracy"], abs=1 / 359)


def _readme_example_commands() -> list[str]:
    """The example commands of the getting-started guide (the README links to it)."""
    text = (ROOT / "docs" / "getting-started.md").read_text()
    section = text[text.index("## Examples") :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [
        line.split("  #")[0].strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip() and not line.startswith("#")
    ]


@pytest.mark.slow
def test_readme_example_commands_run_as_written(tmp_path):
    """In a folder that looks like a fresh clone (examples, configs and .venv linked), so
    the runs/ they write land in tmp_path."""
    commands = _readme_example_commands()
    assert len(commands) >= 3
    for name in ("examples", "configs", ".venv"):
        (tmp_path / name).symlink_to(ROOT / name)
    for command in commands:
        done = subprocess.run(
            command, shell=True, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"


def test_fsdp_lm_trains_hsdp_and_matches_the_plain_step(tmp_path):
    """The MaxText-style trainer: a scanned, rematerialised stack, FSDP in each of 2 slices."""
    code = _load("fsdp_lm").main(
        ["--steps", "8", "--check-steps", "3", "--layers", "2", "--dim", "32", "--out", str(tmp_path), "--no-progress"]
    )
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mesh"] == {"data": 2, "fsdp": 4}
    assert summary["max_relative_loss_difference_to_plain_step"] < 1e-5
    assert summary["final_loss"] < summary["first_loss"] - 0.5  # it learns the chain


@pytest.mark.parametrize(
    "args, message",
    [(["--devices", "8", "--slices", "3"], "not divisible by --slices"), (["--dim", "30"], "divisible by the 4 FSDP")],
)
def test_fsdp_lm_refuses_bad_options_first(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        _load("fsdp_lm").main([*args, "--out", str(tmp_path)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_equinox_digits_trains_equinoxs_own_step_and_matches_it(tmp_path):
    """Equinox's data-parallel example as written (filter_jit, filter_shard, a sharding
    argument, activation functions as leaves), scheduled."""
    code = _load("equinox_digits").main(["--steps", "30", "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"] == "MLP"
    assert summary["max_relative_loss_difference_to_plain_step"] < 1e-5
    assert summary["final_loss"] < summary["first_loss"] - 0.5  # it learns the digits


def test_equinox_digits_refuses_bad_options_first(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _load("equinox_digits").main(["--batch-size", "60", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "not divisible by --devices" in capsys.readouterr().err
