"""The command line: options checked before any work, defaults shown, layering, progress."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxsched.tools import cli
from jaxsched.demo import config
from jaxsched.demo import trainer
from jaxsched.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if any training starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("training started before the options were checked")

    monkeypatch.setattr(trainer, "train_side_by_side", refuse)
    monkeypatch.setattr(trainer, "train", refuse)


def test_unknown_strategy_fails_before_training_naming_value_and_choices(no_training, capsys, tmp_path):
    log = tmp_path / "runs" / "x.jsonl"
    code = main(["train", "--config", "configs/mlp_digits.toml", "--strategies", "allreduce,dearr", "--log", str(log)])
    assert code == 2
    err = capsys.readouterr().err
    assert "--strategies: 'dearr' is unknown; choose from allreduce, wfbp, dear" in err
    assert not log.parent.exists()  # nothing ran, nothing was written


@pytest.mark.parametrize(
    "argv,message",
    [
        (["simulate", "--workers", "8"], "one of the arguments --model --profile is required"),
        (["profile"], "the following arguments are required: --model"),
        (["simulate", "--model", "vgg16", "--workers", "0"], "--workers: 0 must be positive"),
        (["simulate", "--model", "vgg16", "--density", "2"], "--density: 2.0 must be in (0, 1]"),
        (["simulate", "--profile", "no/such/layers.json"], "file 'no/such/layers.json' does not exist"),
        (["profile", "--model", "mlp", "--devices", "many"], "--devices: 'many' is not an integer"),
        (["train", "--config", "configs/mlp_digits.toml", "--strategies", ","], "no names in ','"),
        (["verify", "--config", "configs/mlp_digits.toml", "--steps", "-1"], "--steps: -1 must be positive"),
        (["verify", "--config", "configs/mlp_digits.toml", "--precision", "half"], "invalid choice: 'half'"),
        (["inspect", "--model", "mlp", "--target", "h100"], "TARGET:TOPOLOGY"),
        (["inspect", "--model", "resnet", "--target", "h100:1x2x4"], "'resnet' is not a zoo model"),
        (["launch", "--hosts", "0", "--", "true"], "--hosts: 0 must be positive"),
        (["launch", "--hosts", "2", "--port", "70000", "--", "true"], "70000 is not a port"),
        (["launch", "--hosts", "2", "--grace", "-1", "--", "true"], "--grace: -1.0 must be positive"),
    ],
)
def test_bad_options_fail_at_parse_time(argv, message, no_training, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "command,shown",
    [
        (
            "simulate",
            ["(default: 8)", "(default: 10gbe)", "(default: allreduce,wfbp,mgwfbp,bytescheduler,dear,approx)"],
        ),
        ("profile", ["(default: 64)", "(default: layers.json)", "(default: none)"]),
        ("demo", ["(default: runs/demo.jsonl)"]),
    ],
)
def test_help_shows_defaults(command, shown, capsys):
    assert main([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for text in shown:
        assert text in out, text
    assert "(default: None)" not in out


def test_help_shows_each_default_once():
    """The formatter adds "(default: X)" to every option with a default; its help text must
    not say it again."""
    import argparse

    subparsers = cli.build_parser()._subparsers._group_actions[0]
    for command, parser in subparsers.choices.items():
        for action in parser._actions:
            if action.default in (None, False, argparse.SUPPRESS) or not action.help:
                continue
            assert "default" not in action.help, (command, action.option_strings, action.help)


def test_version_names_jaxsched_and_jax(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("jaxsched 0.1.0 (jax 0.10.2, jaxlib 0.10.2)")


def test_every_subcommand_module_registers_through_one_function():
    import argparse
    import importlib

    for name in cli.COMMAND_MODULES:
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers(dest="command")
        importlib.import_module(name).register(sub)
        assert sub.choices, name
        for command, sub_parser in sub.choices.items():
            assert callable(sub_parser.get_default("run")), (name, command)
    assert set(cli.build_parser()._subparsers._group_actions[0].choices) == {
        "train",
        "demo",
        "verify",
        "simulate",
        "profile",
        "cluster",
        "launch",
        "bench",
        "inspect",
    }


def test_sim_and_plan_do_not_import_the_cli():
    """Layering: the simulator and planners run without the command line."""
    code = (
        "import sys, jaxsched.sim, jaxsched.plan, jaxsched.sim._timeline; "
        "bad = [m for m in sys.modules if m.startswith('jaxsched.tools.cli')]; "
        "assert not bad, bad; import jaxsched.tools.cli; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_python_dash_m_jaxsched_runs_the_cli():
    done = subprocess.run(
        [sys.executable, "-m", "jaxsched", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0
    for command in ("train", "demo", "simulate", "profile"):
        assert command in done.stdout


def _tiny(api: str = "shard_map", **train):
    return config.parse(
        {
            "model": {"name": "mlp", "hidden": [16]},
            "data": {"name": "digits", "batch_size": 32},
            "train": {"steps": 30, "devices": 8, "api": api, **train},
        }
    )


def test_progress_in_a_log_is_a_few_lines_not_redraws(capsys):
    trainer.train(_tiny(devices=1), "allreduce", progress=True)
    err = capsys.readouterr().err  # captured: not a TTY
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("mlp/allreduce")]
    assert 2 <= len(lines) <= 11, lines
    assert lines[-1].startswith("mlp/allreduce: 30/30 done")


@pytest.mark.parametrize("api", ["shard_map", "pmap"])
def test_the_plain_step_compiles_only_on_its_first_call(api):
    """A fresh state on one device made the plain step compile again on step 2, inside the
    timed steps, and halved its steps/s in the demo (docs/benchmarks.md)."""
    compiles_per_call: list[int] = []
    compiling = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: compiling.append(event) if event.endswith("backend_compile_duration") else None
    )

    def counting_wrap(step, strategy):
        runner = trainer.default_wrap(step, strategy)

        class Counting:
            init, finalize = runner.init, runner.finalize

            def __call__(self, state, batch):
                before = len(compiling)
                out = jax.block_until_ready(runner(state, batch))
                compiles_per_call.append(len(compiling) - before)
                return out

        return Counting()

    trainer.train(_tiny(api, steps=3), "allreduce", progress=False, wrap=counting_wrap)
    assert compiles_per_call[0] >= 1 and compiles_per_call[1:] == [0, 0], compiles_per_call


def test_side_by_side_training_gives_each_strategy_its_own_run():
    results = trainer.train_side_by_side(_tiny(steps=3), ["allreduce", "wfbp"], progress=False)
    assert [r.strategy for r in results] == ["allreduce", "wfbp"]
    assert all(len(r.losses) == 3 and r.median_step_s > 0 for r in results)
    assert max(abs(a - b) for a, b in zip(results[0].losses, results[1].losses)) < 1e-4


def test_launch_drops_gloo_chatter_unless_verbose():
    import io
    import threading

    from jaxsched.tools.launch import GLOO_CHATTER, _pump

    text = b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\nloss 0.5\n"
    for drop, expected in ((GLOO_CHATTER, "[0] loss 0.5\n"), (None, "[0] " + text.decode().replace("\n", "\n[0] ", 1))):
        out = io.StringIO()
        _pump(io.BytesIO(text), out, "[0] ", threading.Lock(), drop)
        assert out.getvalue() == expected
