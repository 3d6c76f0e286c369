import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from relax.core.metrics import MetricsError, MetricsLogger, notify
from relax.core.metrics_plot import plot_curves, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def steps(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_jsonl_console_and_resume_truncation(tmp_path):
    out = io.StringIO()
    with MetricsLogger(tmp_path, backends=["console"], console_keys=["reward/mean", "kl"], stream=out) as m:
        for s in range(1, 5):
            m.log(s, {"reward/mean": s / 10, "kl": np.float32(0.5), "loss": torch.tensor(2.0 * s)})
        m.log(5, {"reward/mean": float("nan")})
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 1 | reward/mean 0.1 | kl 0.5"
    rows = steps(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2]["reward/mean"] == 0.3 and rows[2]["loss"] == 6.0 and rows[2]["kl"] == 0.5
    assert rows[4]["reward/mean"] is None  # NaN written as null: valid JSON
    # a half-written last line from a crash, then resume at step 2: later steps are gone
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "rew')
    with MetricsLogger(tmp_path, backends=[], resume_step=2) as m:
        m.log(3, {"reward/mean": 0.9})
    assert [(r["step"], r["reward/mean"]) for r in steps(tmp_path / "metrics.jsonl")] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.9),
    ]
    # a fresh (non-resumed) run starts a new file
    MetricsLogger(tmp_path, backends=[]).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_bad_values_and_backends(tmp_path):
    with MetricsLogger(tmp_path, backends=[]) as m, pytest.raises(TypeError, match="metric 'x' at step 1"):
        m.log(1, {"x": "high"})
    with pytest.raises(MetricsError, match=r"unknown metrics backend\(s\) \['tb'\]; allowed"):
        MetricsLogger(tmp_path, backends=["tb"])
    try:
        import clearml  # noqa: F401
    except ImportError:
        with pytest.raises(MetricsError, match="clearml package is not installed"):
            MetricsLogger(tmp_path, backends=["clearml"])


def test_tensorboard_events_hold_the_logged_values(tmp_path):
    with MetricsLogger(tmp_path, backends=["tensorboard"]) as m:
        for s in range(1, 4):
            m.log(s, {"reward/mean": 0.25 * s, "response_length/mean": 10.0 + s})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"reward/mean", "response_length/mean"}
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [e.value for e in acc.Scalars("response_length/mean")] == [11.0, 12.0, 13.0]


def test_wandb_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsLogger(tmp_path, backends=["wandb"], run_name="t", config={"lr": 1e-3}) as m:
        m.log(1, {"reward/mean": 0.5})
        m.log(2, {"reward/mean": 0.75})
    run_id = (tmp_path / "wandb_run_id").read_text()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1
    assert (runs[0] / f"run-{run_id}.wandb").stat().st_size > 0


def test_plot_curves_writes_png(tmp_path):
    with MetricsLogger(tmp_path, backends=[]) as m:
        for s in range(1, 11):
            m.log(s, {"reward/mean": s / 10, "response_length/mean": 20 - s})
    png = plot_curves(tmp_path / "metrics.jsonl", tmp_path / "plots" / "curves.png")
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (700, 520)  # 7 x 2.6*2 inches at 100 dpi
    assert [r["reward/mean"] for r in read_metrics(tmp_path / "metrics.jsonl")][-1] == 1.0
    with pytest.raises(
        ValueError, match=r"no values for \['kl'\]; available metrics: \['response_length/mean'"
    ):
        plot_curves(tmp_path / "metrics.jsonl", tmp_path / "x.png", keys=["kl"])


@pytest.fixture
def webhook():
    received, status = [], [200]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers["Content-Type"], json.loads(body)))
            self.send_response(status[0])
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", received, status
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_notify_posts_json_and_never_raises(webhook, caplog):
    url, received, status = webhook
    assert notify(url + "/hook", "run_finished", {"step": 7, "reward": 0.9}) is True
    assert received == [("/hook", "application/json", {"event": "run_finished", "step": 7, "reward": 0.9})]
    status[0] = 500
    assert notify(url, "run_failed", {"error": "boom"}) is False
    assert "answered HTTP 500" in caplog.text
    closed = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    dead_url = f"http://127.0.0.1:{closed.server_port}"
    closed.server_close()
    assert notify(dead_url, "run_failed", timeout_s=1) is False
    assert notify("apprise://nowhere", "x") is False
    assert "failed" in caplog.text
