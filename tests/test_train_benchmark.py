"""benchmarks/train.py's loop over variants: one that fails leaves a row with its error, the others are measured
and written, and the exit status says a variant failed (`measure` stubbed: the loop's bookkeeping, no compile)."""

from __future__ import annotations

import importlib.util
import json
import sys

from conftest import ROOT


def test_a_failing_variant_leaves_an_error_row_and_the_others(tmp_path, monkeypatch):
  sys.path.insert(0, str(ROOT / "benchmarks"))
  try:
    spec = importlib.util.spec_from_file_location("train_benchmark", ROOT / "benchmarks" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
  finally:
    sys.path.remove(str(ROOT / "benchmarks"))
  monkeypatch.setattr(train.common, "RESULTS", tmp_path)
  measured = []

  def measure(cfg, steps):
    if cfg.model.wkv7_impl == "chunked":
      raise RuntimeError("Mosaic GPU needs sm_90\nsecond line")
    measured.append(cfg.model.layer_pattern)
    return {"step_ms": 1.0, "tokens_per_s": 2.0, "model_tflops": 3.0}

  monkeypatch.setattr(train, "measure", measure)
  monkeypatch.setattr(sys, "argv", ["train.py", "--config", str(ROOT / "configs" / "tiny.py"), "--name", "t",
                                    "--variant", "", "--variant", "model.wkv7_impl=chunked",
                                    "--variant", "model.layer_pattern=A"])
  assert train.main() == 1
  rows = json.loads((tmp_path / f"t-{train.common.device_name()}.json").read_text())["results"]
  assert [r["variant"] for r in rows] == ["(as is)", "model.wkv7_impl=chunked", "model.layer_pattern=A"]
  assert rows[1]["error"] == "RuntimeError: Mosaic GPU needs sm_90" and "step_ms" not in rows[1]
  assert all("error" not in rows[i] and rows[i]["step_ms"] == 1.0 for i in (0, 2)) and len(measured) == 2
  monkeypatch.setattr(sys, "argv", ["train.py", "--config", str(ROOT / "configs" / "tiny.py"), "--name", "t",
                                    "--variant", ""])
  assert train.main() == 0


def test_timed_steps_carry_the_donated_state_through_every_call():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  try:
    import common  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(str(ROOT / "benchmarks"))
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  step = jax.jit(lambda state, batch: ((state[0] + batch, state[1] + 1), {"loss": state[1]}), donate_argnums=0)
  batch = np.random.default_rng(0).standard_normal(16).astype(np.float32)
  state, metrics, timed = common.time_train_steps(step, (np.zeros(16, np.float32), np.int32(0)), batch, steps=3)
  # 2 warm-up steps, 3 waited for one by one, 3 back to back: each call continues from the state the last returned.
  np.testing.assert_allclose(state[0], 8 * batch, rtol=1e-6)
  assert int(state[1]) == 8 and int(metrics["loss"]) == 7
  assert len(timed["step_times_ms"]) == 3 and timed["step_ms"] in timed["step_times_ms"]
  assert all(timed[k] > 0 for k in ("dispatch_ms", "step_ms_pipelined"))
