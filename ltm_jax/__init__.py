"""ltm_jax: Latent Thought language models in JAX/Flax.

    import ltm_jax
    cfg = ltm_jax.load_config("configs/tiny.py", ["model.d_model=64"])
    lm = ltm_jax.build(cfg)              # or ltm_jax.load("runs/tiny") for a trained workdir
    lm.generate("Python is", max_new_tokens=50)
"""

from ltm_jax.api import LanguageModel, build, load
from ltm_jax.config import Config, DataConfig, LatentConfig, ModelConfig, TrainConfig, load_config
from ltm_jax.train import train

__version__ = "0.1.0"
