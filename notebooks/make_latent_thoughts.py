"""Writes notebooks/02_latent_thoughts.ipynb from the cells below (edit here, rerun, execute, commit both)."""

from make_quickstart import write

CELLS = [
    ("markdown", """# Latent thought vectors that carry information

A Latent Thought model reads, in every block, a few latent vectors z through cross-attention. z is not computed by
an encoder: it is *inferred* for each sequence by a short inner loop of Adam on the posterior q(z|x) = N(mu, sigma^2),
minimising the negative ELBO (token NLL + KL to the prior N(0, I)).

z only matters where the decoder cannot see for itself. `configs/ltm_window.py` gives it that room: attention-only
layers with a 32-byte sliding window over 512-byte sequences, so a logit sees at most `receptive_field` = 125 bytes
back, and anything further can only arrive through z. Its twin `configs/ltm_window_plain.py` is the same decoder
without latents. Both are trained here on the same batches, then compared on **continuation**: z fitted on the
first half of a window, the second half scored (the number comparable with an autoregressive LM), and we check that
the decoder reads z by continuing one prompt under z fitted on different documents."""),
    ("code", """import os
import pathlib
import tempfile

import matplotlib.pyplot as plt
import numpy as np
import optax

import ltm_jax
from ltm_jax import data as data_lib
from ltm_jax.train.metrics import read_metrics

ROOT = next(p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents] if (p / "configs" / "tiny.py").exists())
TESTING = "LTM_NOTEBOOK_STEPS" in os.environ  # The test suite runs this notebook with a few steps in a temp dir.
# Continuation training on every sequence: see docs/latent-thoughts.md for why and for the alternatives.
LATENT = ["latent.continuation_fraction=1.0"]
STEPS = [f"train.steps={os.environ['LTM_NOTEBOOK_STEPS']}", "train.eval_every=12", "train.batch_size=4",
         "train.eval_batches=1", "train.seq_len=128", "model.n_layers=1", "latent.inner_steps=2"] if TESTING else []
ltm_cfg = ltm_jax.load_config(ROOT / "configs" / "ltm_window.py", LATENT + STEPS)
plain_cfg = ltm_jax.load_config(ROOT / "configs" / "ltm_window_plain.py", STEPS)
# The workdirs of `python benchmarks/latent.py window` (variants "plain" and "ltm_cont100"): finished runs are reused.
RUNS = pathlib.Path(tempfile.mkdtemp()) if TESTING else ROOT / "runs" / "latent-window"
print(ltm_cfg.latent)
print("receptive field without z:", ltm_cfg.model.receptive_field, "bytes of", ltm_cfg.train.seq_len)"""),
    ("markdown", """## Train both (about 15 + 5 minutes on 2 CPU cores; a finished run is only reloaded)
Each latent step fits every sequence's posterior with `latent.inner_steps` Adam steps (fast learning), then takes
one decoder step on the NLL given z drawn from it, z held fixed (slow learning). With
`latent.continuation_fraction=1`, z is fitted on a random prefix of each sequence and the decoder is scored on the
rest given it (and the prefix given the loop's uninformative starting point z_0), so it learns to read z as a memory
of text it cannot see."""),
    ("code", """ltm_jax.train(plain_cfg, RUNS / "plain", progress=False)
ltm_jax.train(ltm_cfg, RUNS / "ltm_cont100", progress=False)
lm, plain = ltm_jax.load(RUNS / "ltm_cont100"), ltm_jax.load(RUNS / "plain")"""),
    ("markdown", """## Diagnostics logged at every evaluation
Training logs what `ltm eval` reports, so collapse would show as it happens: `val_shuffled_nll` (z of another
sequence) and `val_prior_nll` (z from the prior) above `val_nll` mean the decoder reads z; `val_kl` is what z
costs; `val_continuation_ppl` is the comparison with the plain decoder."""),
    ("code", """ltm_rows = [r for r in read_metrics(RUNS / "ltm_cont100") if "val_nll" in r]
plain_rows = [r for r in read_metrics(RUNS / "plain") if "val_nll" in r]
tokens = lambda rows: [r["tokens"] / 1e6 for r in rows]
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
a.plot(tokens(plain_rows), [r["val_continuation_ppl"] for r in plain_rows], "k--o", label="plain windowed decoder")
a.plot(tokens(ltm_rows), [r["val_continuation_ppl"] for r in ltm_rows], "-o", label="latent thoughts")
a.set_xlabel("training tokens (M)"), a.set_ylabel("continuation perplexity"), a.legend(), a.grid(alpha=0.3)
for key, label in (("val_nll", "own z"), ("val_shuffled_nll", "shuffled z"), ("val_prior_nll", "prior z")):
  b.plot(tokens(ltm_rows), [r[key] for r in ltm_rows], "-o", label=label)
b.set_xlabel("training tokens (M)"), b.set_ylabel("validation NLL, nats/byte"), b.legend(), b.grid(alpha=0.3)
plt.show()
last = ltm_rows[-1]
print({k: round(v, 4) for k, v in last.items() if k.startswith("val_") and isinstance(v, float)})"""),
    ("markdown", """## Fit z for a few sequences and watch the ELBO
`fit_latents` returns the fitted posterior and, for every sequence, the NLL and KL before each inner step (with the
inner loop's fixed noise draw). The negative ELBO per token falls as the loop runs; the KL is what z costs."""),
    ("code", """splits = data_lib.load_splits(ltm_cfg.data, ltm_cfg.model.vocab_size, ltm_cfg.train.seq_len)
length = ltm_cfg.train.seq_len
windows = np.stack([splits.val[i * 9973: i * 9973 + length + 1] for i in range(4)])
fit = lm.fit_latents(windows, steps=4 if TESTING else 32)
elbo = np.asarray(fit.nll + fit.kl) / length
fig, ax = plt.subplots(figsize=(6, 3.5))
for i in range(elbo.shape[1]):
  ax.plot(elbo[:, i], label=f"sequence {i}")
ax.plot(np.asarray(fit.kl).mean(1) / length, "k--", label="KL (mean)")
ax.set_xlabel("inner step"), ax.set_ylabel("negative ELBO, nats/byte"), ax.legend(), ax.grid(alpha=0.3)
plt.show()"""),
    ("markdown", """## Same prompt, different thoughts
Three validation documents on different subjects. z is fitted on the first 256 bytes of each; then the *same*
prompt is continued under each z with the same sampling seed, so only z differs. If the decoder reads z, each continuation
drifts toward its own document; under the plain decoder there is nothing to drift with. The second half of each
document is also scored under every z: its own z should predict it best."""),
    ("code", """val = np.asarray(splits.val)
blob = np.where(val < 256, val, 0).astype(np.uint8).tobytes()  # Byte ids are the bytes (specials masked).
markers = (b">>> Color.RED", b"ALERT_DESCRIPTION_", b"insertontime")  # enum, ssl, tkinter docs in CPython 3.11's split
starts = [blob.find(m) if blob.find(m) >= 200 else (i + 1) * (len(blob) - 2 * length) // 4  # Other Pythons.
          for i, m in enumerate(markers)]
docs = np.stack([val[s - 200: s - 200 + length + 1] for s in starts])
half = length // 2
fitted = lm.fit_latents(docs[:, :half + 1], seed=0).posterior.mu  # z from each document's first half only.
prompt, sampling = "\\n", dict(max_new_tokens=16 if TESTING else 120, temperature=0.7, top_p=0.95, seed=1)
for i, s in enumerate(starts):
  print(f"--- z from document {i}: ...{lm.decode(docs[i, half - 60:half])!r}")
  print(repr(lm.generate(prompt, latents=fitted[i:i + 1], **sampling)))
print("--- plain decoder")
print(repr(plain.generate(prompt, **sampling)))

def second_half_nll(model, tokens, z=None):
  logits = model.forward(tokens[:, :-1], z) if z is not None else model.forward(tokens[:, :-1])
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  return np.asarray(nll[:, half:].mean(-1))

table = np.stack([second_half_nll(lm, docs, np.repeat(fitted[j:j + 1], len(docs), 0)) for j in range(len(docs))])
print("second-half NLL (nats/byte), rows: z from document j, columns: document scored")
print(np.round(table, 3))
print("plain decoder:", np.round(second_half_nll(plain, docs), 3))"""),
    ("markdown", """## A learned prior over z
The decoder was trained against the prior N(0, I), but the posteriors it learned to read sit elsewhere (their
aggregate has a standard deviation near 0.27 per coordinate), so z drawn from N(0, I) is unlike anything it was
trained on. A learned prior is a second stage on the frozen decoder: `ltm fit-prior` stores the posteriors of its
training windows, `ltm train-prior` fits a DiT to them by denoising, and `latents="dit"` samples z from it
(DPM-Solver++, 20 steps). `benchmarks/latent.py prior` measures how close each source of z comes to held-out
posteriors; here are unconditional samples (no prompt) under each, same sampling seed."""),
    ("code", """# The decoder and prior of `benchmarks/latent.py prior`; without them (and in the test), a prior for `lm` is trained here.
prior_run = RUNS / "ltm_cont100_500"
if TESTING or not (prior_run / "prior" / "checkpoints").is_dir():
  from ltm_jax.prior import posteriors
  from ltm_jax.prior.train import train_prior
  prior_run = RUNS / "ltm_cont100"
  posteriors.collect(lm, prior_run, **(dict(sequences=16, batch_size=4, shard_size=8) if TESTING else {}))
  train_prior(prior_run, ["prior.steps=4", "prior.width=32", "prior.depth=1", "prior.batch_size=4"] if TESTING else [],
              log=lambda _: None)
prior_lm = ltm_jax.load(prior_run)
sampling = dict(max_new_tokens=16 if TESTING else 160, temperature=0.7, top_p=0.95)
for seed in range(1 if TESTING else 3):
  print(f"--- seed {seed}, z ~ N(0, I)")
  print(repr(prior_lm.generate("", latents="prior", seed=seed, **sampling)))
  print(f"--- seed {seed}, z from the DiT prior")
  print(repr(prior_lm.generate("", latents="dit", seed=seed, **sampling)))"""),
    ("markdown", """## Where to go from here
This notebook trains z the original way, as `configs/ltm_window.py` pins it: every block reads z, and 8 inner steps
of Adam from a prior-like start fit it, at 6.98x the plain decoder's training FLOPs, on the small embedded corpus,
where nothing beyond the window is worth much. `LatentConfig`'s defaults cost 1.45x (`ltm info` prints the ratio for
any config): the top block alone reads z, and an encoder's proposal is refined by 2 inner steps on the prefix. `docs/latent-thoughts.md` measures z where it has something to carry:
synthetic Markov documents whose Bayes-optimal continuation is known in closed form (`configs/ltm_markov.py`), and a
107 MB corpus of Python source (`ltm build-corpus`, `configs/ltm_code.py`), at equal tokens and at equal training
FLOPs; and it measures each lever of the latent step's cost."""),
]


if __name__ == "__main__":
  write(CELLS, "02_latent_thoughts.ipynb")
