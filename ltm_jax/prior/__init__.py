"""A learned prior over latent thoughts: a DiT fitted by denoising to the frozen decoder's posteriors.

  ltm fit-prior --workdir DIR      # posteriors.collect: stage-2 data in DIR/prior/posteriors
  ltm train-prior --workdir DIR    # train.train_prior: checkpoints in DIR/prior/checkpoints
  ltm_jax.load(DIR).dit_latents(8) # model.LatentPrior.sample
"""

from ltm_jax.prior.model import LatentPrior, load_prior

__all__ = ["LatentPrior", "load_prior"]
