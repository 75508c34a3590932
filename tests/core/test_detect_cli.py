import json

import numpy as np

from greyhound.detect_cli import main


def _write(path, values):
    path.write_text("".join(f"{v}\n" for v in values))
    return str(path)


def test_prints_one_json_line_per_file(tmp_path, capsys):
    rng = np.random.default_rng(0)
    x = 0.2 * np.exp(rng.normal(0, 0.02, 500))
    x[250:400] *= 1.6
    a = _write(tmp_path / "a.txt", x)
    b = _write(tmp_path / "b.txt", 0.2 * np.exp(rng.normal(0, 0.02, 300)))
    assert main([a, b]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["path"] == a and second == {"path": b, "detections": []}
    kinds = [d["kind"] for d in first["detections"]]
    assert kinds == ["slowdown", "recovery"]
    slow = first["detections"][0]
    assert set(slow) == {"index", "detected_at", "kind", "before_s", "after_s", "change",
                         "healthy_s", "stage", "suspected_at"}
    assert slow["change"] == "onset" and first["detections"][1]["change"] == "full"
    # printed at its confirmation, five points from its start, and it says when it was suspected
    assert slow["stage"] == "confirmed" and 250 <= slow["suspected_at"] <= 253
    assert slow["detected_at"] == slow["index"] + 4 and abs(slow["index"] - 250) <= 2


def test_each_stage_prints_each_slowdown_once(tmp_path, capsys):
    rng = np.random.default_rng(1)
    x = 0.2 * np.exp(rng.normal(0, 0.02, 400))
    x[200:204] *= 2.0   # a four-iteration burst: suspected, then withdrawn
    x[300:] *= 1.6      # a fail-slow: suspected, then confirmed
    p = _write(tmp_path / "t.txt", x)
    got = {}
    for stage in ("confirmed", "suspected", "all"):
        assert main(["--stage", stage, p]) == 0
        got[stage] = [(d["kind"], d["change"], d["stage"], d["index"])
                      for d in json.loads(capsys.readouterr().out)["detections"]]
    assert [g[:2] for g in got["confirmed"]] == [("slowdown", "onset")]
    assert [g[:3] for g in got["suspected"]] == [("slowdown", "onset", "suspected")] * 2
    assert [g[:3] for g in got["all"]] == [
        ("slowdown", "onset", "suspected"), ("recovery", "withdrawn", "confirmed"),
        ("slowdown", "onset", "suspected"), ("slowdown", "onset", "confirmed")]


def test_method_choice(tmp_path, capsys):
    x = np.full(200, 0.1)
    x[100:] = 0.2
    p = _write(tmp_path / "s.txt", x)
    for method in ("bocd-v", "bocd", "window"):
        assert main(["--method", method, p]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["detections"][0]["kind"] == "slowdown"


def test_bad_input_exits_2_with_a_clear_message(tmp_path, capsys):
    assert main([str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    p = _write(tmp_path / "bad.txt", ["0.1", "0.2", "oops"])
    assert main([p]) == 2
    assert "bad.txt:3: not a number" in capsys.readouterr().err
    n = _write(tmp_path / "neg.txt", ["0.1", "-0.2"])
    assert main([n]) == 2
    assert "neg.txt:2: negative" in capsys.readouterr().err
    assert main(["--method", "nope", p]) == 2
