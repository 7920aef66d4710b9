"""Two processes on localhost joined by jax.distributed (CPU collectives over gloo) train like one process; the
per-process pieces (data rows, start-up settings, MFU) are checked on their own."""

from __future__ import annotations

import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import cpu_only_env
from ltm_jax.data.loader import TrainLoader
from ltm_jax.errors import ConfigError
from ltm_jax.parallel import distributed
from ltm_jax.train.metrics import peak_tflops, read_metrics, throughput

ROOT = pathlib.Path(__file__).resolve().parents[2]
OVERRIDES = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=128", "train.steps=3",
             "train.batch_size=4", "train.seq_len=32", "train.log_every=1", "train.eval_every=100",
             "train.eval_batches=1", "train.warmup_steps=2", "data.worker_threads=1", "data.prefetch=2"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.long
def test_two_processes_train_like_one(tmp_path):
  """`ltm train` as 2 processes x 1 CPU device (mesh data=2: each process loads and runs 2 of the 4 rows) against the
  same run as 1 process. Loss and gradient norm agree to float32 reassociation (1e-5 relative); only process 0
  writes metrics; both processes' checkpoint shards make one checkpoint.

  Every run is a subprocess on the CPU (CPU collectives join the two; the GPU, where there is one, is hidden), without
  XLA's expensive passes: the single-process run compiled for a GPU would differ from the CPU runs by the platforms'
  float32 arithmetic, not by the split into processes."""
  port = _free_port()
  env = cpu_only_env(JAX_DISABLE_MOST_OPTIMIZATIONS="1")
  env.pop("XLA_FLAGS", None)
  train_argv = [sys.executable, "-m", "ltm_jax", "train", "--config", str(ROOT / "configs/tiny.py"), *OVERRIDES]
  procs = [subprocess.Popen(
      [*train_argv, "--workdir", str(tmp_path / "multi"), "--coordinator-address", f"localhost:{port}",
       "--num-processes", "2", "--process-id", str(i)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for i in range(2)]
  outputs = [p.communicate(timeout=300) for p in procs]
  for p, (out, err) in zip(procs, outputs):
    assert p.returncode == 0, err[-3000:]
  assert "done: step 3" in outputs[0][0] and "step" not in outputs[1][0]  # Process 1 reports nothing.

  single = subprocess.run([*train_argv, "--workdir", str(tmp_path / "single")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
  assert single.returncode == 0 and "done: step 3" in single.stdout, single.stderr[-3000:]
  multi_rows, single_rows = read_metrics(tmp_path / "multi"), read_metrics(tmp_path / "single")
  assert [r["step"] for r in multi_rows] == [r["step"] for r in single_rows] == [1, 2, 3]
  for a, b in zip(multi_rows, single_rows):
    for key in ("loss", "grad_norm", "val_loss"):
      if key in b:
        assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key, a[key], b[key])
  assert (tmp_path / "multi/checkpoints/3").is_dir()


def test_loader_shards_tile_the_global_batch():
  tokens = np.random.default_rng(0).integers(0, 259, 5000).astype(np.uint16)
  whole = TrainLoader(tokens, 8, 16, seed=3, worker_threads=0, prefetch=0)
  parts = [TrainLoader(tokens, 8, 16, seed=3, worker_threads=0, prefetch=0, shard=(i, 4)) for i in range(4)]
  for _ in range(3):
    batch = next(whole)
    pieces = [next(p) for p in parts]
    assert all(p["inputs"].shape == (2, 16) for p in pieces)
    np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in pieces]), batch["inputs"])
    np.testing.assert_array_equal(np.concatenate([p["targets"] for p in pieces]), batch["targets"])
  assert parts[2].get_state() == whole.get_state()  # One global position, whatever the shard.
  for loader in [whole, *parts]:
    loader.close()
  with pytest.raises(ValueError, match="count dividing batch_size=8"):
    TrainLoader(tokens, 8, 16, seed=3, shard=(0, 3))


def test_distributed_settings():
  assert distributed.settings(env={}) is None
  assert distributed.settings("h:1", 2, 1, env={}) == {"coordinator_address": "h:1", "num_processes": 2,
                                                       "process_id": 1}
  env = {"LTM_COORDINATOR_ADDRESS": "10.0.0.1:5000", "LTM_NUM_PROCESSES": "4", "LTM_PROCESS_ID": "3"}
  assert distributed.settings(env=env) == {"coordinator_address": "10.0.0.1:5000", "num_processes": 4,
                                           "process_id": 3}
  assert distributed.settings(process_id=0, env=env)["process_id"] == 0  # Flags win over the environment.
  assert distributed.settings(env={"SLURM_NTASKS": "8", "SLURM_PROCID": "5"}) == {}  # jax reads SLURM itself.
  assert distributed.settings(env={"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
  with pytest.raises(ConfigError, match="needs all three"):
    distributed.settings("h:1", 2, None, env={})
  with pytest.raises(ConfigError, match=r"process id 2 must be in \[0, 2\)"):
    distributed.settings("h:1", 2, 2, env={})
  with pytest.raises(ConfigError, match="LTM_NUM_PROCESSES='two' is not an integer"):
    distributed.settings(env={**env, "LTM_NUM_PROCESSES": "two"})


def test_mfu_against_the_peak_table():
  assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
  assert peak_tflops("NVIDIA H100 PCIe") == 756.0
  assert peak_tflops("NVIDIA H200") == 989.0
  assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
  assert peak_tflops("cpu") is None
  # 4 steps of 2.5e15 FLOPs in 10 s over 8 devices: 125 TFLOP/s per device, 125/989 of an H100's peak.
  row = throughput(2.5e15, 4, 10.0, 8, "NVIDIA H100 80GB HBM3")
  assert row["model_tflops_per_device"] == pytest.approx(125.0)
  assert row["mfu"] == pytest.approx(125.0 / 989.0)
  assert "mfu" not in throughput(1e9, 1, 1.0, 1, "cpu")
