"""``jaxsched simulate`` end to end: table, JSON, trace, PNG, errors."""

from __future__ import annotations

import json

from jaxsched.tools.cli import main
from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
from jaxsched.sim import simulate


def test_simulate_writes_json_trace_and_png(tmp_path, capsys):
    # Output folders that do not exist yet are created.
    out, trace, png = tmp_path / "a" / "out.json", tmp_path / "b" / "t.trace.json", tmp_path / "c" / "d" / "g.png"
    code = main(
        [
            "simulate",
            "--model",
            "resnet50",
            "--workers",
            "64",
            "--network",
            "10gbe",
            "--device",
            "v100",
            "--strategies",
            "allreduce,wfbp,mgwfbp,bytescheduler,dear,approx",
            "--planner",
            "optimal",
            "--json",
            str(out),
            "--trace",
            str(trace),
            "--png",
            str(png),
            "--no-progress",
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "SIMULATED" in table and "speedup" in table and "% of bound" in table
    data = json.loads(out.read_text())
    assert set(data["strategies"]) == {"allreduce", "wfbp", "mgwfbp", "bytescheduler", "dear", "approx"}
    assert data["bound_s"] == max(data["compute_s"], data["comm_s"])
    for name, result in data["strategies"].items():
        assert result["iteration_s"] >= data["bound_s"] * (1 - 1e-12), name
        assert sorted(i for b in result["buckets"] for i in b) == list(range(54))
    assert data["strategies"]["allreduce"]["buckets"] == [list(range(54))]
    # The optimal plan is never worse than per-layer WFBP.
    assert data["strategies"]["wfbp"]["iteration_s"] <= data["strategies"]["allreduce"]["iteration_s"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["ph"] for e in events} == {"M", "X"}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_a_user_profile_matches_the_library(tmp_path):
    layers = LayerProfile([Layer(f"l{i}", 10**6, 4 * 10**6, 1e-3 * (i + 1), 2e-3) for i in range(6)])
    net = network_preset("25gbe", 8)
    layers.save(tmp_path / "layers.json")
    net.save(tmp_path / "net.json")
    out = tmp_path / "out.json"
    assert (
        main(
            [
                "simulate",
                "--profile",
                str(tmp_path / "layers.json"),
                "--network-profile",
                str(tmp_path / "net.json"),
                "--strategies",
                "allreduce,wfbp,wfbp+gtopk",
                "--planner",
                "per_layer",
                "--json",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["strategies"]["wfbp"]["iteration_s"] == simulate(layers, net, "wfbp").iteration_s
    assert data["strategies"]["wfbp+gtopk"]["options"]["compression"] == "gtopk"


def test_simulate_reports_bad_input_clearly(tmp_path, capsys):
    bad = tmp_path / "layers.json"
    bad.write_text(json.dumps({"layers": [{"name": "a", "params": 1, "bytes": 4, "forward_s": 1}]}))
    assert main(["simulate", "--profile", str(bad), "--no-progress"]) == 2
    assert "field 'backward_s' is missing" in capsys.readouterr().err
    assert main(["simulate", "--model", "vgg16", "--strategies", "wfbp,fastest", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--strategies: 'fastest' is unknown; choose from allreduce, wfbp" in err
    assert main(["simulate", "--model", "vgg16", "--strategies", "wfbp+zip", "--no-progress"]) == 2
    assert "compression 'zip' in 'wfbp+zip' is unknown; use +topk or +gtopk" in capsys.readouterr().err


def test_simulate_a_two_level_cluster_hierarchical_and_flat(tmp_path):
    import json

    from jaxsched.tools.cli import main

    out = {}
    for name, extra in (("hier", []), ("flat", ["--flat"])):
        path = tmp_path / f"{name}.json"
        assert main(
            [
                "simulate",
                "--model",
                "resnet50",
                "--workers",
                "64",
                "--network",
                "nvlink4+400gbib",
                "--per-node",
                "8",
                "--device",
                "h100",
                "--strategies",
                "allreduce",
                "--no-progress",
                "--json",
                str(path),
            ]
            + extra
        ) in (0, None)
        out[name] = json.loads(path.read_text())
    assert out["hier"]["simulated"] is True
    hier, flat = (out[k]["strategies"]["allreduce"]["iteration_s"] for k in ("hier", "flat"))
    assert hier < flat
