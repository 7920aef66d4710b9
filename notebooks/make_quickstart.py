"""Writes notebooks/01_quickstart.ipynb from the cells below (edit here, rerun, commit both)."""

import pathlib

import nbformat

CELLS = [
    ("markdown", """# ltm_jax quickstart

Build a tiny byte-level language model from a config, train it for a few hundred steps on the embedded corpus
(Python's own documentation, no download), plot the loss and sample text. Runs on a laptop CPU in a few minutes."""),
    ("code", """import os
import pathlib
import tempfile

import matplotlib.pyplot as plt

import ltm_jax
from ltm_jax.train.metrics import read_metrics

STEPS = int(os.environ.get("LTM_NOTEBOOK_STEPS", 300))  # The test suite runs this notebook with fewer steps,
# smaller batches and 2 layers.
SMALL = ["train.batch_size=8", "train.eval_batches=2", "model.n_layers=2"] if "LTM_NOTEBOOK_STEPS" in os.environ else []
ROOT = next(p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents] if (p / "configs" / "tiny.py").exists())"""),
    ("markdown", """## A model from a config in three lines
Any config key can be overridden with `key=value` strings, exactly as on the command line."""),
    ("code", """cfg = ltm_jax.load_config(ROOT / "configs" / "tiny.py", [f"train.steps={STEPS}", "train.eval_every=100",
                                                         "train.log_every=10", *SMALL])
lm = ltm_jax.build(cfg)
print(f"{lm.num_params:,} parameters, layers {cfg.model.layer_pattern} x {cfg.model.n_layers // len(cfg.model.layer_pattern)}")
print("untrained:", repr(lm.generate("The list", max_new_tokens=60, seed=0)))"""),
    ("markdown", """## Train
`ltm_jax.train` is what `ltm train` runs: checkpoints, `metrics.jsonl` and TensorBoard files go to the workdir, and
calling it again on the same workdir resumes."""),
    ("code", """workdir = pathlib.Path(tempfile.mkdtemp(prefix="ltm_quickstart_"))
result = ltm_jax.train(cfg, workdir, progress=False)
print(f"{result.step} steps in {result.seconds:.0f}s, validation bits per byte {result.metrics['val_bpb']:.3f}")"""),
    ("code", """rows = read_metrics(workdir)
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss")
evals = [r for r in rows if "val_loss" in r]
ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation loss")
ax.set_xlabel("step"), ax.set_ylabel("nats per byte"), ax.legend(), ax.grid(alpha=0.3)
plt.show()"""),
    ("markdown", """## Load the trained model and sample
`ltm_jax.load(workdir)` restores the latest checkpoint; `generate` takes a temperature, top-k and top-p."""),
    ("code", """trained = ltm_jax.load(workdir)
for temperature in (0.0, 0.8):
  text = trained.generate("The list", max_new_tokens=200, temperature=temperature, top_p=0.95, seed=1)
  print(f"--- temperature {temperature}\\nThe list{text}\\n")"""),
]


def write(cells, name: str) -> None:
  """Writes notebooks/<name> (without outputs; execute it with `jupyter nbconvert --execute --inplace`)."""
  nb = nbformat.v4.new_notebook()
  nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
  nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
              for kind, src in cells]
  nbformat.write(nb, pathlib.Path(__file__).with_name(name))


def main():
  write(CELLS, "01_quickstart.ipynb")


if __name__ == "__main__":
  main()
