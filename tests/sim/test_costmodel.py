"""Cost model: JSON round trips, errors that name the field, presets, zoo parameter counts."""

from __future__ import annotations

import json

import pytest

from jaxsched.sim._costmodel import (
    DEVICE_PRESETS,
    LINK_PRESETS,
    CollectiveCost,
    Layer,
    LayerProfile,
    NetworkProfile,
    ProfileError,
    device_preset,
    network_preset,
    roofline_seconds,
)
from jaxsched.sim._zoo_profiles import PUBLISHED_PARAMS, ZOO_MODELS, architecture, forward_gflops, zoo_profile


def test_layer_profile_round_trips(tmp_path):
    prof = LayerProfile([Layer("a", 3, 12, 1e-3, 2e-3, 1e-4), Layer("b", 5, 20, 2e-3, 4e-3)], {"model": "x"})
    path = tmp_path / "layers.json"
    prof.save(path)
    assert LayerProfile.load(path) == prof


def test_minimal_schema_from_the_issue_is_readable(tmp_path):
    path = tmp_path / "layers.json"
    path.write_text(
        json.dumps({"layers": [{"name": "fc", "params": 10, "bytes": 40, "forward_s": 0.001, "backward_s": 0.002}]})
    )
    prof = LayerProfile.load(path)
    assert prof.layers[0].update_s == 0.0 and prof.total_bytes == 40
    net_path = tmp_path / "net.json"
    net_path.write_text(
        json.dumps(
            {
                "workers": 4,
                "collectives": {
                    name: {"alpha_s": 1e-5, "beta_s_per_byte": 1e-9}
                    for name in ("all_reduce", "reduce_scatter", "all_gather")
                },
            }
        )
    )
    net = NetworkProfile.load(net_path)
    assert net.time("all_reduce", 1000) == pytest.approx(1e-5 + 1e-6)


def test_network_profile_round_trips(tmp_path):
    net = network_preset("25gbe", 16)
    net.save(tmp_path / "n.json")
    assert NetworkProfile.load(tmp_path / "n.json") == net


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["layers"][1].pop("backward_s"), r"layers\[1\]: field 'backward_s' is missing"),
        (lambda d: d["layers"][0].update(params="ten"), r"layers\[0\]: field 'params'='ten' must be int"),
        (lambda d: d["layers"][0].update(forward_s=-1.0), r"layers\[0\]: field 'forward_s'=-1.0 must be"),
        (lambda d: d.update(layers=[]), r"'layers' must be a non-empty list"),
    ],
)
def test_bad_layer_json_names_file_and_field(tmp_path, mutate, message):
    data = LayerProfile([Layer("a", 1, 4, 1e-3, 1e-3), Layer("b", 1, 4, 1e-3, 1e-3)]).to_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message) as info:
        LayerProfile.load(path)
    assert str(path) in str(info.value)


def test_bad_network_json_names_the_field(tmp_path):
    data = network_preset("10gbe", 4).to_dict()
    del data["collectives"]["all_gather"]
    path = tmp_path / "net.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="collectives.all_gather is missing"):
        NetworkProfile.load(path)
    data = network_preset("10gbe", 4).to_dict()
    data["collectives"]["all_reduce"]["beta_s_per_byte"] = "fast"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="collectives.all_reduce: field 'beta_s_per_byte'"):
        NetworkProfile.load(path)
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        NetworkProfile.load(path)


def test_ring_presets_follow_the_alpha_beta_formulas():
    link = LINK_PRESETS["100gbib"]
    for workers in (2, 8, 64):
        net = network_preset("100gbib", workers)
        ar, rs = net.cost("all_reduce"), net.cost("reduce_scatter")
        assert ar.alpha_s == pytest.approx(2 * (workers - 1) * link.latency_s)
        assert ar.beta_s_per_byte == pytest.approx(2 * (workers - 1) / workers / link.bandwidth_bytes_per_s)
        assert rs.beta_s_per_byte == pytest.approx(ar.beta_s_per_byte / 2)
    assert network_preset("1gbe", 1).time("all_reduce", 10**9) == 0
    # Faster links are faster for a 100 MB all-reduce on 16 workers.
    times = [network_preset(n, 16).time("all_reduce", 10**8) for n in ("1gbe", "10gbe", "25gbe", "100gbib", "nvlink")]
    assert times == sorted(times, reverse=True)


def test_unknown_presets_list_the_choices():
    with pytest.raises(ProfileError, match="1gbe"):
        network_preset("40gbe", 8)
    with pytest.raises(ProfileError, match="v100"):
        device_preset("k80")


def test_presets_cite_sources():
    assert all(p.source for p in LINK_PRESETS.values())
    assert all(p.source for p in DEVICE_PRESETS.values())
    assert set(DEVICE_PRESETS) == {"v100", "a100", "h100", "tpu-v5e"}
    assert set(LINK_PRESETS) == {"1gbe", "10gbe", "25gbe", "100gbib", "nvlink", "nvlink4", "400gbib", "ici", "dcn"}


@pytest.mark.parametrize("model", ZOO_MODELS)
def test_zoo_parameter_counts_match_published_within_half_a_percent(model):
    published, _ = PUBLISHED_PARAMS[model]
    counted = sum(layer.params for layer in architecture(model))
    assert abs(counted - published) / published < 0.005
    prof = zoo_profile(model, "a100")
    assert prof.total_params == counted and prof.total_bytes == 4 * counted
    assert all(l.backward_s == pytest.approx(2 * l.forward_s) for l in prof.layers)


def test_zoo_flops_match_published_macs():
    # Published forward GMACs per image: ResNet-50 4.1, VGG-16 15.5, DenseNet-201 4.3.
    assert forward_gflops("resnet50") / 2 == pytest.approx(4.1, rel=0.03)
    assert forward_gflops("vgg16") / 2 == pytest.approx(15.5, rel=0.03)
    assert forward_gflops("densenet201") / 2 == pytest.approx(4.3, rel=0.03)


def test_roofline_picks_the_binding_limit():
    v100 = device_preset("v100")
    assert roofline_seconds(15.7e12, 0, v100, 1.0) == pytest.approx(1.0)
    assert roofline_seconds(0, 900e9, v100, 0.5) == pytest.approx(2.0)
    # A faster device makes the same model faster.
    assert zoo_profile("bert-base", "h100").forward_s < zoo_profile("bert-base", "v100").forward_s


def test_collective_cost_of_empty_bucket_is_zero():
    assert CollectiveCost(1e-3, 1e-9).time(0) == 0


def test_network_fixed_costs_round_trip_and_old_files_load(tmp_path):
    import dataclasses

    net = dataclasses.replace(network_preset("10gbe", 4), dispatch_s=3e-4, copy_s_per_byte=1e-10)
    net.save(tmp_path / "n.json")
    assert NetworkProfile.load(tmp_path / "n.json") == net
    old = network_preset("10gbe", 4).to_dict()
    assert "dispatch_s" not in old and "copy_s_per_byte" not in old  # schema unchanged when unused
    loaded = NetworkProfile.from_dict(old)
    assert loaded.dispatch_s == 0 and loaded.copy_s_per_byte == 0
    with pytest.raises(ProfileError, match="dispatch_s"):
        NetworkProfile.from_dict({**old, "dispatch_s": -1})


def test_two_level_network_hand_computed():
    from jaxsched.sim._costmodel import LINK_PRESETS, two_level_network

    f, s = LINK_PRESETS["nvlink4"], LINK_PRESETS["400gbib"]
    net = two_level_network("nvlink4", "400gbib", nodes=8, per_node=8)
    nbytes = 100e6
    # reduce-scatter in the node, all-reduce of 1/8 across 8 nodes, all-gather in the node
    within = 7 * f.latency_s + 7 / 8 * nbytes / f.bandwidth_bytes_per_s
    across = 2 * 7 * s.latency_s + 2 * 7 / 8 * (nbytes / 8) / s.bandwidth_bytes_per_s
    assert net.time("all_reduce", nbytes) == pytest.approx(2 * within + across)
    assert net.time("reduce_scatter", nbytes) == pytest.approx(
        within + 7 * s.latency_s + 7 / 8 * (nbytes / 8) / s.bandwidth_bytes_per_s
    )
    flat = two_level_network("nvlink4", "400gbib", nodes=8, per_node=8, hierarchical=False)
    assert flat.time("all_reduce", nbytes) == pytest.approx(
        2 * 63 * s.latency_s + 2 * 63 / 64 * nbytes / s.bandwidth_bytes_per_s
    )
    # the hierarchy sends 1/8 of the bytes over the slow links (and NVLink is 9x faster)
    assert net.time("all_reduce", nbytes) < 0.25 * flat.time("all_reduce", nbytes)
    assert net.workers == 64 and net.meta["levels"]["per_node"] == 8


def test_two_level_preset_needs_devices_per_node():
    from jaxsched.sim._costmodel import ProfileError, network_preset

    assert network_preset("ici+dcn", 16, per_node=4).workers == 16
    with pytest.raises(ProfileError, match="needs per_node"):
        network_preset("ici+dcn", 16)
    with pytest.raises(ProfileError, match="unknown network preset 'infiniband'.*fast\\+slow"):
        network_preset("nvlink4+infiniband", 16, per_node=8)
