"""Latent thought vectors where they have something to carry: an attention-only byte-level decoder whose sliding
window (32 bytes) is far shorter than its 512-byte sequences, so z (2 vectors per layer, read by cross-attention in
every block) is the only route to anything further back. Trains in about 15 minutes on 2 CPU cores.

RWKV layers are left out on purpose: their recurrence carries context past any window, which would give the decoder
a second route around z. `configs/ltm_window_plain.py` is the same decoder without latents, the baseline.

It keeps the form of the windowed-regime studies (docs/latent-thoughts.md, `benchmarks/latent.py window`, whose
variants are changes from it): z in every block, 8 inner steps from the prior-like start on whole rows, 6.98x
the plain step's training FLOPs. `configs/ltm_code.py` is the same decoder in the efficient form (1.45x)."""

from ltm_jax.config import Config, DataConfig, LatentConfig, ModelConfig, TrainConfig


def get_config() -> Config:
  return Config(
      name="ltm_window",
      model=ModelConfig(d_model=128, n_layers=4, n_heads=4, layer_pattern="A", window=32, max_seq_len=512),
      data=DataConfig(source="embedded"),
      train=TrainConfig(steps=250, batch_size=16, seq_len=512, lr=4e-3, warmup_steps=50, eval_every=50,
                        eval_batches=2, checkpoint_every=50, log_every=10),
      latent=LatentConfig(enabled=True, n_per_layer=2, top_layers=None, inner_steps=8, inner_lr=0.3, init_logvar=-5.0,
                          encoder=False, continuation_fraction=0.0),
  )
