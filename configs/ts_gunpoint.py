"""GunPoint (UCR archive, shipped with aeon): 2 classes, 50 training and 150 test series of 150 steps. The
dual-branch model: 4 RWKV-7 layers of width 64 over the raw steps, mean-pooled, fused with the spectrum branch,
trained on all 50 training series (as the archive's 1-NN baselines use them) for 300 steps of 16; the test split is
scored once, at the last step. About 2-3 minutes on 2 CPU cores:
`ltm train --config configs/ts_gunpoint.py --workdir runs/ts_gunpoint` (`timeseries.val_fraction=0.2` holds out 10
training series for val_* metrics).
"""

from ltm_jax.config import Config, DataConfig, ModelConfig, TimeSeriesConfig, TrainConfig


def get_config() -> Config:
  return Config(
      name="ts_gunpoint",
      model=ModelConfig(d_model=64, n_layers=4, n_heads=4, layer_pattern="W", rwkv7_head_size=16, ln0=True),
      timeseries=TimeSeriesConfig(enabled=True, source="aeon:GunPoint", val_fraction=0.0, patch=1, pool="mean",
                                  branch="spectrum", spectrum_bins=32, spectrum_max_period=256.0),
      data=DataConfig(worker_threads=1, prefetch=2),
      train=TrainConfig(steps=300, batch_size=16, lr=2e-3, warmup_steps=30, weight_decay=0.05, eval_every=50,
                        checkpoint_every=100, log_every=25),
  )
