"""Latent thoughts on documents whose optimum is known: every sequence is one document of 257 symbols from its own
random Markov chain over 16 states (Dirichlet(0.1) transition rows; ltm_jax/data/markov.py), read by an
attention-only decoder with a 16-token sliding window over 4 layers, so a logit sees the last 61 symbols. A
document's chain is what z is for: fitted on the first half, it can carry the transition counts the window has lost.
`benchmarks/latent.py markov` scores the second halves against the oracle, the Bayes predictor from the whole prefix
and the Bayes predictor from the last 61 symbols; `configs/ltm_markov_plain.py` is the decoder without latents.

64 latent vectors (four per state, if the decoder wants it so), read by the top block only (the efficient latent
step: the blocks below run once per train step); semi-amortised inference: an encoder proposes the posterior's mean
and 2 inner steps refine it; every sequence is trained on continuation (z fitted on a prefix, the rest scored)."""

from ltm_jax.config import Config, DataConfig, LatentConfig, ModelConfig, TrainConfig


def get_config() -> Config:
  return Config(
      name="ltm_markov",
      model=ModelConfig(d_model=128, n_layers=4, n_heads=4, layer_pattern="A", window=16, max_seq_len=256),
      data=DataConfig(source="markov", markov_symbols=16, markov_concentration=0.1),
      train=TrainConfig(steps=2000, batch_size=16, seq_len=256, lr=3e-3, warmup_steps=100, eval_every=250,
                        eval_batches=4, checkpoint_every=250, log_every=50),
      latent=LatentConfig(enabled=True, n_per_layer=64, top_layers=1, inner_steps=2, inner_lr=0.1,
                          continuation_fraction=1.0, encoder=True),
  )
