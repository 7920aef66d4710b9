"""The peers the benchmarks compare against: which are importable here, their versions, and the wheels that bring them
(and the ltm_jax dependencies the GPU image lacks) to a GPU machine that cannot reach a package index.

  python benchmarks/peers.py                  # one line per peer: importable or why not, version, benchmarks
  python benchmarks/peers.py --download .whl --wheels peers  # the peers' wheels for the GPU image (CPython 3.12,
      # x86-64) into .whl/: carry the folder there and run gpu_sweep.py --wheels .whl; `--wheels suite` for make test-gpu

Peer code is only ever imported from its installed package, never copied here. This module imports no JAX, so the
sweep driver can use it without touching the accelerator.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import pathlib
import subprocess
import sys
from collections.abc import Iterable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Peer:
  """module: what must import for the peer to run; dists: distributions whose installed version identifies it (the
  first one found); benchmarks: the scripts that run it; what: the function(s) they call."""
  module: str
  dists: tuple[str, ...]
  benchmarks: tuple[str, ...]
  what: str


PEERS = {
    "rwkv": Peer("rwkv", ("rwkv",), ("wkv4", "decode"),
                 "the official RWKV-4 CUDA kernel (rwkv/cuda/, built with torch.utils.cpp_extension.load) and the "
                 "official model's forward"),
    "fla-core": Peer("fla", ("fla-core", "flash-linear-attention"), ("wkv4", "wkv7"),
                     "flash-linear-attention's Triton kernels fla.ops.rwkv4.fused_recurrent_rwkv4 and "
                     "fla.ops.rwkv7.chunk_rwkv7"),
    "jax-linear-attention": Peer("jla", ("jax-linear-attention",), ("wkv7", "attention"),
                                 "Pallas Mosaic GPU kernels: jla.ops.mosaic_gpu.rwkv7.rwkv7 and "
                                 "jla.layers.attention.attention(implementation='mosaic_gpu')"),
    "tokamax": Peer("tokamax", ("tokamax",), ("attention",), "tokamax.dot_product_attention"),
    "rwkv-ops": Peer("rwkv_ops", ("rwkv-ops",), ("wkv7",), "rwkv_ops.generalized_delta_rule (JAX, Triton kernels)"),
    "torch": Peer("torch", ("torch",), ("wkv4", "wkv7", "attention", "decode"),
                  "torch.nn.functional.scaled_dot_product_attention; the runtime of the rwkv and fla-core peers"),
    "cudnn": Peer("jax", ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"), ("attention",),
                  "jax.nn.dot_product_attention(implementation='cudnn'), when jax has a CUDA backend"),
}

# Wheels for the GPU machines' image (Python 3.12, jax 0.11.2, torch 2.11, no package index), installed there with
# --no-deps: the peers, the imports each needs that the image lacks (found by importing them over a copy of that
# image's packages), ltm_jax's own imports the image lacks (grain, tensorboardX), and what the test suite imports
# that the image lacks (`make test-gpu`: the dev extra's packages and the closure of their Requires-Dist, less the
# image's own packages). Pinned, so that a sweep on one day compares against the same peers as the next, and one
# version of each (two stop the install). rwkv-ops is left out: it needs keras, which the image lacks too.
# Wheels for the GPU image (CPython 3.12), which lacks them, in sets: ltm_jax's own dependencies and `rwkv` (the
# converter test's and the peers'; the image has torch); pydantic (openai's and tokamax's); what the rest of the test
# suite needs (the serve extra and the clients its tests talk to it with, notebooks, aeon, their dependencies, and
# setuptools for the editable install without build isolation: the project needs >= 77); the benchmarks' other peers
# and their imports (xprof, through tokamax._src.benchmarking, is 32 MB).
_OWN = ("grain==0.2.18", "array-record==0.8.6", "portpicker==1.6.0", "tensorboardx==2.6.5", "rwkv==0.8.32")
_PYDANTIC = ("pydantic==2.14.3", "pydantic-core==2.50.4", "annotated-types==0.8.0", "typing-inspection==0.4.5",
             "typing-extensions==4.16.0")
_TESTS = (
    "starlette==1.10.0", "uvicorn==0.54.0", "openai==3.57.0", "httpx2==2.16.2", "httpcore2==2.16.2", "jiter==0.19.0",
    "sniffio==1.3.1", "truststore==0.10.5", "nbclient==0.11.0", "nbformat==5.11.1", "fastjsonschema==2.22.3",
    "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1",
    "jupyter-client==8.10.0", "jupyter-core==5.9.1", "platformdirs==4.14.8", "pyzmq==27.3.0", "tornado==6.6.1",
    "traitlets==5.16.1", "ipykernel==7.4.0", "comm==0.2.3", "debugpy==1.8.22", "matplotlib-inline==0.2.2",
    "nest-asyncio2==1.7.4", "ipython==9.18.1", "ipython-pygments-lexers==1.1.1", "jedi==0.20.1", "parso==0.8.7",
    "pexpect==4.9.0", "ptyprocess==0.7.0", "prompt-toolkit==3.0.53", "wcwidth==0.9.4", "stack-data==0.6.3",
    "asttokens==3.0.2", "executing==2.3.0", "pure-eval==0.2.4", "aeon==1.6.0", "deprecated==1.3.1",
    "setuptools==84.2.1",
)
_PEERS = ("fla-core==0.6.0", "jax-linear-attention==0.1.0", "tokamax==0.0.17", "einshape==1.0", "qwix==0.1.8",
          "immutabledict==4.3.1", "xprof==2.24.2", "fire==0.7.1", "termcolor==3.3.0")
# `suite`: what `make test-gpu` needs; `peers`: what the benchmarks need; `all` is over the device tool's 64 MiB carry
# limit (about 68 MiB), so a session carries one of the other two.
WHEELS = {"suite": _OWN + _PYDANTIC + _TESTS, "peers": _OWN + _PYDANTIC + _PEERS, "all": _OWN + _PYDANTIC + _TESTS + _PEERS}
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                   "manylinux2014_x86_64", "manylinux1_x86_64")


def installed_version(dists: Iterable[str]) -> str | None:
  """The version of the first of `dists` that is installed, or None."""
  for dist in dists:
    try:
      return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      continue
  return None


def status() -> dict[str, dict[str, Any]]:
  """{peer: {importable, version, benchmarks[, reason]}} for every peer. A peer counts as importable only once its
  module imports (a package whose own imports are missing fails there, e.g. tokamax without xprof)."""
  out = {}
  for name, peer in PEERS.items():
    entry: dict[str, Any] = {"version": installed_version(peer.dists), "benchmarks": list(peer.benchmarks)}
    try:
      importlib.import_module(peer.module)
      entry["importable"] = True
    except Exception as e:  # noqa: BLE001  (any failure to import means the peer cannot run here)
      entry["importable"] = False
      entry["reason"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if name == "cudnn" and entry["importable"]:
      # cuDNN attention runs only through a CUDA plugin; whether a GPU is there is the benchmark's to find out.
      plugin = installed_version(("jax-cuda13-plugin", "jax-cuda12-plugin"))
      if plugin is None:
        entry.update(importable=False, reason="no jax CUDA plugin installed")
    out[name] = entry
  return out


def versions(names: Iterable[str]) -> dict[str, str | None]:
  """{peer: installed version or None}, from package metadata alone (imports nothing): for results files."""
  return {name: installed_version(PEERS[name].dists) for name in names}


def download(folder: pathlib.Path, wheels: Iterable[str] = WHEELS["all"]) -> int:
  """pip-downloads `wheels` (no dependencies: each set names every wheel it needs) for the GPU image into `folder`."""
  platforms = [arg for platform in WHEEL_PLATFORMS for arg in ("--platform", platform)]
  command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
             "--implementation", "cp", *platforms, "-d", str(folder), *wheels]
  return subprocess.run(command, check=False).returncode


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--download", type=pathlib.Path, metavar="DIR", help="download wheels for the GPU image")
  parser.add_argument("--wheels", choices=sorted(WHEELS), default="all",
                      help="which wheels: what make test-gpu needs (suite), the benchmarks' peers with ltm_jax's own "
                           "dependencies (peers), or both (all, over the device tool's carry limit)")
  args = parser.parse_args()
  if args.download is not None:
    sys.exit(download(args.download, WHEELS[args.wheels]))
  for name, entry in status().items():
    found = "importable" if entry["importable"] else f"missing ({entry.get('reason', '')})"
    print(f"{name:22s} {entry['version'] or '-':12s} {found}; used by {', '.join(entry['benchmarks'])}")


if __name__ == "__main__":
  main()
