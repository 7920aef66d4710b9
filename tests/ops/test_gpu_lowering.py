"""The GPU lowering is chosen in one place (`ltm_pallas.backend.gpu_lowering`): the Pallas Triton lowering while jax
has it (sm_80 and sm_90 alike), the ops' XLA backends under `impl="auto"` once it is gone, a Mosaic GPU kernel only
for an op that has one and only on sm_90+; jax's per-kernel deprecation warning is replaced by one notice per
process. The jax version, the lowering's presence and the GPU's capability are given as arguments; the two
end-to-end checks run in subprocesses (one as if jax had dropped the lowering, one in the AOT venv's jax 0.11)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import jax
import pytest

from conftest import ROOT
from ltm_jax.ops import backend as ops_backend
from ltm_pallas import backend

AOT_PYTHON = ROOT / ".venv-aot" / "bin" / "python"
DEPRECATION = ("The Pallas Triton backend is deprecated and will be removed in a future JAX version. To keep using "
               "Pallas on GPU, please migrate to the Mosaic GPU backend.")


@pytest.mark.parametrize("capability", [None, (8, 0), (9, 0)])
def test_triton_while_jax_has_it_on_a100_and_hopper_alike(capability):
  old = backend.gpu_lowering(version=(0, 10), triton=True, capability=capability)
  assert old == backend.GpuLowering("triton", None)  # Not deprecated yet: nothing to say.
  new = backend.gpu_lowering(version=(0, 11), triton=True, capability=capability)
  assert new.name == "triton"
  assert "jax 0.11 deprecates" in new.notice and "sm_80" in new.notice and "XLA backends" in new.notice


def test_xla_backends_once_jax_drops_the_triton_lowering():
  lowering = backend.gpu_lowering(version=(0, 13), triton=False, capability=(8, 0))
  assert lowering.name == "xla"
  assert "jax 0.13 has no Pallas Triton lowering" in lowering.notice and "\n" not in lowering.notice


@pytest.mark.parametrize("triton", [True, False])
def test_a_mosaic_gpu_kernel_only_on_sm90_and_newer(triton):
  other = "triton" if triton else "xla"
  for capability, expected in (((8, 0), other), ((8, 9), other), ((9, 0), "mosaic_gpu"), ((10, 0), "mosaic_gpu"),
                               (None, other)):
    chosen = backend.gpu_lowering(version=(0, 11), triton=triton, capability=capability, mosaic_gpu=True)
    assert chosen.name == expected, (capability, chosen)
  # An op without a Mosaic GPU kernel keeps Triton on Hopper too.
  assert backend.gpu_lowering(version=(0, 11), triton=True, capability=(9, 0)).name == "triton"


def test_each_notice_is_said_once():
  said = set()
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    assert backend.notice_once("first", said)
    assert not backend.notice_once("first", said)
    assert not backend.notice_once(None, said)
    assert backend.notice_once("second", said)
  assert [(w.category, str(w.message)) for w in seen] == [(backend.LoweringNotice, "first"),
                                                          (backend.LoweringNotice, "second")]


def test_the_triton_deprecation_is_silenced_and_nothing_else():
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    backend.quiet_triton_deprecation()
    backend.quiet_triton_deprecation()
    ours = [f for f in warnings.filters if f[1] is not None and f[1].pattern.startswith("The Pallas Triton")]
    warnings.warn(DEPRECATION, DeprecationWarning)
    warnings.warn("another deprecation", DeprecationWarning)
    # A filter put in front of ours (a test runner's "always", say) is got past by the next call.
    warnings.filterwarnings("always", category=DeprecationWarning)
    backend.quiet_triton_deprecation()
    warnings.warn(DEPRECATION, DeprecationWarning)
  assert len(ours) == 1
  assert [str(w.message) for w in seen] == ["another deprecation"]


def test_auto_tables_without_the_kernels():
  auto = {"cpu": "scan", "gpu": "pallas_segmented"}
  triton = backend.gpu_lowering(version=(0, 11), triton=True)
  assert ops_backend.kernel_free(auto, {"gpu": "chunked"}, triton) == auto
  gone = backend.GpuLowering("xla", "test_auto_tables_without_the_kernels: said once")
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for _ in range(2):
      assert ops_backend.kernel_free(auto, {"gpu": "chunked"}, gone) == {"cpu": "scan", "gpu": "chunked"}
  assert [str(w.message) for w in seen] == [gone.notice]
  assert ops_backend.kernel_free(auto, {}, gone) == auto  # An op whose auto table runs no kernel.


def _run(python, code: str, **env) -> subprocess.CompletedProcess:
  return subprocess.run([str(python), "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                        text=True, timeout=300)


def test_auto_compiles_no_kernel_for_a_gpu_when_jax_lacks_the_triton_lowering():
  """As if jax had dropped the Triton lowering (its module cannot be imported), in a process that can compile for
  a GPU: every op's `auto` lowers for CUDA without a Triton call, and one notice says so."""
  code = """
import sys, warnings
sys.modules["jax.experimental.pallas.triton"] = None  # Importing it raises ImportError.
import jax, jax.numpy as jnp
from jax import export
from ltm_jax import ops
from ltm_jax.ops.quant_matmul import quant_matmul
from ltm_pallas import backend
backend.may_compile_for_gpu = lambda: True  # As on a GPU host, or with the CUDA plugin installed.
x = jax.random.normal(jax.random.key(0), (1, 32, 2, 16))
k = jax.random.normal(jax.random.key(1), (2, 8, 4096))
values = jax.random.randint(jax.random.key(2), (1, 64, 32), -100, 100).astype(jnp.int8)
cases = [lambda x: ops.wkv7(x, -jnp.exp(x), x, x, -x, x)[0], lambda x: ops.attention(x, x, x, causal=True),
         lambda k: ops.wkv4(-jnp.exp(k[0, 0]), k[0, 1], k, k)[0],
         lambda k: quant_matmul(k[0, :, :64], values, jnp.ones((1, 32)), packed=False)]
with warnings.catch_warnings(record=True) as seen:
  warnings.simplefilter("always")
  for fn, arg in zip(cases, (x, x, k, k)):
    text = export.export(jax.jit(fn), platforms=["cuda"])(arg).mlir_module()
    assert "triton" not in text and "pallas" not in text, text[:2000]
notices = [str(w.message) for w in seen if w.category is backend.LoweringNotice]
assert len(notices) == 1 and "has no Pallas Triton lowering" in notices[0], [str(w.message) for w in seen]
print("ok")
"""
  out = _run(sys.executable, code, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.skipif(not (ROOT / ".venv-aot" / ".installed").exists(),
                    reason="needs .venv-aot (jax 0.11 with the CUDA plugin; `make gpu-aot` builds it)")
def test_jax_011_lowers_kernels_for_a_gpu_with_one_notice_and_no_deprecation_warning():
  """In the AOT venv's jax (0.11, which deprecates the Triton lowering): two kernels lowered for an H100 without a
  GPU (deviceless, as benchmarks/gpu_aot.py does) give one LoweringNotice and no DeprecationWarning."""
  code = """
import sys, warnings
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec
from gpu_aot import H100_TARGET_CONFIG
from ltm_jax import ops
from ltm_pallas import backend
assert backend.jax_version() >= backend.TRITON_DEPRECATED_SINCE, jax.__version__
topology = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET_CONFIG, topology="1x1x1")
mesh = topologies.make_mesh(topology, (1,), ("x",))
on_gpu = NamedSharding(mesh, PartitionSpec())
with warnings.catch_warnings(record=True) as seen:
  warnings.simplefilter("always")
  for channels in (4096, 8192):
    k = jax.ShapeDtypeStruct((2, 16, channels), jnp.float32, sharding=on_gpu)
    w = jax.ShapeDtypeStruct((channels,), jnp.float32, sharding=on_gpu)
    fn = jax.jit(lambda w, u, k, v: ops.wkv4(w, u, k, v, impl="pallas")[0])
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      assert "triton" in fn.trace(w, w, k, k).lower().as_text()
said = [(w.category.__name__, str(w.message)) for w in seen]
assert [c for c, _ in said] == ["LoweringNotice"], said
assert "deprecates" in said[0][1], said
print("ok")
"""
  out = _run(AOT_PYTHON, code, JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_mosaic_gpu_kernels_refuse_gpus_before_hopper():
  with pytest.raises(NotImplementedError, match="sm_90 or newer; this GPU is sm_80"):
    backend.require_mosaic_gpu((8, 0))
  backend.require_mosaic_gpu((9, 0))
  backend.require_mosaic_gpu((10, 0))


def test_mosaic_gpu_kernels_compile_on_a_gpu_host_and_interpret_elsewhere(monkeypatch):
  """`mosaic_gpu_call` decides when tracing, by the default backend: a `lax.platform_dependent` holding Mosaic GPU's
  interpreter (ordered host callbacks) cannot be lowered for a GPU."""
  built = []

  def build(interpreted):
    built.append(interpreted)
    return lambda *args: args

  backend.mosaic_gpu_call(build, None)
  backend.mosaic_gpu_call(build, False)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(backend, "require_mosaic_gpu", lambda capability=None: None)
  backend.mosaic_gpu_call(build, None)
  backend.mosaic_gpu_call(build, True)
  assert built == [True, False, False, True]
