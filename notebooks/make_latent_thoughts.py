"""Writes notebooks/02_latent_thoughts.ipynb from the cells below (edit here, rerun, execute, commit both)."""

from make_quickstart import write

CELLS = [
    ("markdown", """# Latent thought vectors

A Latent Thought model reads, in every block, a few latent vectors z through cross-attention. z is not computed by
an encoder: it is *inferred* for each sequence by a short inner loop of Adam on the posterior q(z|x) = N(mu, sigma^2),
minimising the negative ELBO (token NLL + KL to the prior N(0, I)). Here we train the tiny latent config briefly, fit
z for a few sequences, watch the ELBO fall with inner steps, and continue a text under posterior and prior z."""),
    ("code", """import os
import pathlib
import tempfile

import jax
import matplotlib.pyplot as plt
import numpy as np

import ltm_jax
from ltm_jax import data as data_lib

STEPS = int(os.environ.get("LTM_NOTEBOOK_STEPS", 150))  # The test suite runs this notebook with fewer steps.
ROOT = next(p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents] if (p / "configs" / "tiny.py").exists())
cfg = ltm_jax.load_config(ROOT / "configs" / "tiny_ltm.py", [f"train.steps={STEPS}", "train.batch_size=16",
                                                             "train.eval_every=100", "train.eval_batches=4",
                                                             "train.log_every=25", "train.warmup_steps=20"])
print(cfg.latent)"""),
    ("markdown", """## Train (dual rate)
Each step fits every sequence's posterior with `latent.inner_steps` Adam steps (fast learning), then takes one
decoder step on the NLL given z drawn from it, z held fixed (slow learning). The log shows the NLL (`loss`) and the
KL per token separately."""),
    ("code", """workdir = pathlib.Path(tempfile.mkdtemp(prefix="ltm_latent_"))
result = ltm_jax.train(cfg, workdir, progress=False)
lm = ltm_jax.load(workdir)
print(f"{result.step} steps in {result.seconds:.0f}s; validation NLL {result.metrics['val_nll']:.3f} + "
      f"KL {result.metrics['val_kl']:.3f} nats/token")"""),
    ("markdown", """## Fit z for a few sequences and watch the ELBO
`fit_latents` returns the fitted posterior and, for every sequence, the NLL and KL before each inner step (with the
inner loop's fixed noise draw). The negative ELBO per token falls as the loop runs; the KL is what z costs."""),
    ("code", """splits = data_lib.load_splits(cfg.data, cfg.model.vocab_size, cfg.train.seq_len)
windows = np.stack([splits.val[i * 997: i * 997 + cfg.train.seq_len + 1] for i in range(4)])
fit = lm.fit_latents(windows, steps=32)
tokens = windows.shape[1] - 1
elbo = np.asarray(fit.nll + fit.kl) / tokens
fig, ax = plt.subplots(figsize=(6, 3.5))
for i in range(elbo.shape[1]):
  ax.plot(elbo[:, i], label=f"sequence {i}")
ax.plot(np.asarray(fit.kl).mean(1) / tokens, "k--", label="KL (mean)")
ax.set_xlabel("inner step"), ax.set_ylabel("negative ELBO, nats/token"), ax.legend(), ax.grid(alpha=0.3)
plt.show()"""),
    ("markdown", """## Does the decoder use z?
Scoring each sequence under its own posterior mean, under another sequence's, and under the prior mean."""),
    ("code", """import optax

def nll(latents):
  logits = lm.forward(windows[:, :-1], latents)
  return float(optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean())

mu = fit.posterior.mu
print(f"own z      {nll(mu):.4f} nats/token")
print(f"shuffled z {nll(np.roll(mu, 1, axis=0)):.4f}")
print(f"prior mean {nll(np.zeros_like(mu)):.4f}")"""),
    ("markdown", """## Continue a text under posterior and prior z
With `latents="posterior"` (the default for a prompt) z is inferred from the prompt before decoding; with
`latents="prior"` it is drawn from N(0, I), i.e. the model writes unconditionally of any inferred "thought"."""),
    ("code", """prompt = lm.decode(windows[0, :96])
print("PROMPT:", repr(prompt[-120:]))
for latents in ("posterior", "prior"):
  text = lm.generate(prompt, max_new_tokens=120, temperature=0.7, top_p=0.95, seed=0, latents=latents)
  print(f"--- {latents}\\n{text}\\n")"""),
]


if __name__ == "__main__":
  write(CELLS, "02_latent_thoughts.ipynb")
