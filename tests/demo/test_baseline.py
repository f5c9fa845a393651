"""The reference data-parallel step and the trainer built on it."""

import json
import re

import jax
import numpy as np
import optax
import pytest

from jaxsched.tools import cli
from jaxsched.demo import config
from jaxsched.zoo import data
from jaxsched.zoo import models
from jaxsched.demo import steps
from jaxsched.demo import trainer


def _tiny_config(**train):
    return config.parse(
        {
            "model": {"name": "mlp", "hidden": [64]},
            "data": {"name": "digits", "batch_size": 64},
            "optimizer": {"name": "adam", "learning_rate": 3e-3},
            "train": {"steps": 10, "devices": 8, **train},
        }
    )


@pytest.mark.slow  # a heavy compile: runs in `make test-slow` (CI runs both)
def test_mlp_on_digits_reaches_90_percent_test_accuracy():
    cfg = config.parse(
        {
            "model": {"name": "mlp", "hidden": [128, 128]},
            "data": {"name": "digits", "batch_size": 128},
            "optimizer": {"name": "adam", "learning_rate": 3e-3},
            "train": {"steps": 250, "devices": 8, "seed": 1},
        }
    )
    result = trainer.train(cfg, progress=False)
    assert result.test_accuracy >= 0.90, result.test_accuracy
    assert result.losses[-1] < result.losses[0] / 5


def _run_steps(step, params, opt_state, batches, place):
    for batch in batches:
        params, opt_state, aux = step(params, opt_state, place(batch))
        jax.block_until_ready(aux)
    return params, opt_state


def _problem(model="mlp", seed=0, **model_options):
    split = data.load_digits()
    params, apply_fn = models.pure(models.build(model, (8, 8, 1), 10, seed=seed, **model_options))
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(10):
        idx = rng.choice(len(split.train_x), 64, replace=False)
        batches.append((split.train_x[idx], split.train_y[idx]))
    return params, apply_fn, batches


@pytest.mark.parametrize(
    "model,options",
    [("mlp", {"hidden": (32,)}), pytest.param("cnn", {"channels": 8, "blocks": 1}, marks=pytest.mark.slow)],
)  # the heaviest compiles run in `make test-slow` (CI runs both)
def test_one_device_and_eight_devices_give_the_same_parameters(model, options):
    params, apply_fn, batches = _problem(model, seed=3, **options)
    tx = optax.adam(1e-2)
    results = []
    for n in (1, 8):
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        step = steps.make_step(apply_fn, tx, mesh)
        results.append(_run_steps(step, params, tx.init(params), batches, lambda b: steps.shard_batch(b, mesh)))
    one, eight = results
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), one[0], params)
    assert max(jax.tree.leaves(moved)) > 1e-3  # training really changed the parameters
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), one, eight)


def test_pmap_and_shard_map_baselines_agree():
    params, apply_fn, batches = _problem(seed=5, hidden=(32,))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
    mesh = jax.make_mesh((8,), ("data",))
    sm = _run_steps(
        steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batches, lambda b: steps.shard_batch(b, mesh)
    )
    pm_step = steps.make_pmap_step(apply_fn, tx)
    pm = _run_steps(pm_step, *steps.replicate((params, tx.init(params)), 8), batches, lambda b: steps.split_batch(b, 8))
    pm = jax.tree.map(lambda a: np.asarray(a)[0], pm)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), sm, pm)


@pytest.mark.slow
def test_trainer_pmap_api_matches_shard_map_losses():
    a = trainer.train(_tiny_config(api="shard_map"), progress=False)
    b = trainer.train(_tiny_config(api="pmap"), progress=False)
    np.testing.assert_allclose(a.losses, b.losses, rtol=1e-5)


@pytest.mark.parametrize(
    "raw,field",
    [
        ({"model": {"name": "resnet9000"}, "data": {"name": "digits"}}, "model.name"),
        (
            {"model": {"name": "mlp"}, "data": {"name": "digits", "batch_size": 100}, "train": {"devices": 8}},
            "data.batch_size",
        ),
        ({"model": {"name": "mlp"}, "data": {"name": "imagenet"}}, "data.name"),
        ({"model": {"name": "mlp"}, "data": {"name": "digits"}, "optimizer": {"name": "lion"}}, "optimizer.name"),
        ({"model": {"name": "mlp"}, "data": {"name": "digits"}, "train": {"steps": "many"}}, "'steps'"),
        ({"model": {"name": "mlp"}, "data": {"name": "digits"}, "train": {"stpes": 3}}, "stpes"),
        ({"data": {"name": "digits"}}, "'name'"),
        (
            {"model": {"name": "mlp"}, "data": {"name": "digits", "batch_szie": 64}},
            "data: unknown field(s) batch_szie; known fields: name, batch_size, test_fraction",
        ),
        (
            {"model": {"name": "mlp", "hiden": [8]}, "data": {"name": "digits"}},
            "model: unknown field(s) hiden; known fields: name, hidden",
        ),
        (
            {"model": {"name": "cnn", "chanels": 8}, "data": {"name": "digits"}},
            "chanels; known fields: name, channels, blocks",
        ),
        (
            {"model": {"name": "transformer", "dims": 8}, "data": {"name": "synthetic_tokens", "seqlen": 8}},
            "model: unknown field(s) dims; known fields: name, dim, heads, layers",
        ),
        (
            {"model": {"name": "mlp"}, "data": {"name": "digits"}, "optimizer": {"lr": 0.1}},
            "lr; known fields: name, learning_rate",
        ),
        (
            {"model": {"name": "mlp"}, "data": {"name": "digits"}, "train": {"strategies": ["dearr"]}},
            "train.strategies: 'dearr' is unknown; choose from allreduce, wfbp, dear",
        ),
    ],
)
def test_bad_config_fails_naming_the_field(raw, field):
    with pytest.raises(config.ConfigError, match=re.escape(field)):
        config.parse(raw)


def test_missing_config_file_is_named(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(config.ConfigError, match="nope.toml"):
        config.load(missing)
    assert cli.main(["train", "--config", str(missing), "--no-progress"]) == 2


def test_more_devices_than_exist_is_a_clear_error():
    cfg = config.parse(
        {"model": {"name": "mlp"}, "data": {"name": "digits", "batch_size": 64}, "train": {"devices": 16}}
    )
    with pytest.raises(config.ConfigError, match="train.devices=16"):
        trainer.train(cfg, progress=False)


def test_every_model_and_data_option_the_config_accepts_really_builds():
    """The accepted fields are the builders' own keyword options, so none is refused late."""
    assert config.model_options("mlp") == ("hidden",)
    assert set(config.data_options("synthetic_tokens")) == {"n", "seq_len", "vocab_size"}
    cfg = config.parse(
        {
            "model": {"name": "cnn", "channels": 4, "blocks": 1},
            "data": {"name": "synthetic_images", "batch_size": 16, "n": 64, "num_classes": 3},
            "train": {"steps": 2, "devices": 8},
        }
    )
    assert trainer.train(cfg, progress=False).steps == 2


def test_cli_train_writes_jsonl_and_summary(tmp_path, capsys):
    cfg_path = tmp_path / "tiny.toml"
    cfg_path.write_text(
        '[model]\nname = "cnn"\nchannels = 4\nblocks = 1\n'
        '[data]\nname = "digits"\nbatch_size = 32\n'
        "[train]\nsteps = 4\ndevices = 8\n"
    )
    log = tmp_path / "runs" / "log.jsonl"  # the README's `--log runs/...`: the folder is created
    assert cli.main(["train", "--config", str(cfg_path), "--log", str(log), "--no-progress"]) == 0
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in rows)
    out = capsys.readouterr().out
    assert "allreduce" in out and "test acc" in out


@pytest.mark.slow  # the heaviest compiles run in `make test-slow` (CI runs both)
def test_transformer_lm_trains_on_synthetic_tokens():
    cfg = config.parse(
        {
            "model": {"name": "transformer", "dim": 32, "heads": 2, "layers": 1},
            "data": {"name": "synthetic_tokens", "batch_size": 32},
            "optimizer": {"name": "adamw", "learning_rate": 1e-2},
            "train": {"steps": 40, "devices": 8},
        }
    )
    result = trainer.train(cfg, progress=False)
    # The Markov chain has 2 successors per token: a model that learned it nears log(2).
    assert result.losses[0] > 3.5 and result.final_loss < 2.0, (result.losses[0], result.final_loss)


def test_every_shipped_config_is_valid():
    from pathlib import Path

    for path in sorted(Path(__file__).resolve().parents[2].glob("configs/*.toml")):
        cfg = config.load(path)
        assert cfg.data.batch_size % cfg.train.devices == 0
        # Every config shows what the library does: the plain step next to scheduled ones.
        assert "allreduce" in cfg.train.strategies, path
        assert {"wfbp", "dear"} & set(cfg.train.strategies), path
