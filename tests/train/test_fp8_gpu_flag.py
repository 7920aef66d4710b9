"""model.fp8 on a GPU warns in one line when XLA's flags leave the FP8 GEMMs to Triton (no FP8 tensor cores)."""

import warnings

import pytest

from ltm_jax import config as config_lib
from ltm_jax.errors import DataError
from ltm_jax.ops import fp8
from ltm_jax.train import task


@pytest.mark.parametrize("flags", ["", "--xla_gpu_autotune_level=0", "--xla_gpu_enable_triton_gemm=true"])
def test_gpu_without_the_flag_is_warned(flags):
  message = fp8.gpu_flag_warning("gpu", flags)
  assert message is not None and "\n" not in message and fp8.GPU_XLA_FLAG in message


@pytest.mark.parametrize("platform, flags", [("gpu", "--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false"),
                                             ("cpu", ""), ("tpu", "")])
def test_the_flag_or_another_platform_is_not_warned(platform, flags):
  assert fp8.gpu_flag_warning(platform, flags) is None


def test_a_gpu_task_with_fp8_warns_before_reading_data(monkeypatch):
  monkeypatch.setattr(task.jax, "default_backend", lambda: "gpu")
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  cfg = config_lib.load_config("configs/tiny.py", ["model.fp8=true", "model.dtype=bfloat16",
                                                   "data.source=/nonexistent-corpus"])
  with warnings.catch_warnings(record=True) as caught, pytest.raises(DataError, match="no such file or folder"):
    warnings.simplefilter("always")
    task.make_task(cfg, None)
  assert any(fp8.GPU_XLA_FLAG in str(w.message) for w in caught)
