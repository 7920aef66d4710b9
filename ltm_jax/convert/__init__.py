"""Importers of official checkpoints into ltm_jax workdirs (PyTorch is needed only while converting)."""

from ltm_jax.convert.rwkv import ConversionError, convert_rwkv, detect_version, model_config, read_checkpoint, to_params

__all__ = ["ConversionError", "convert_rwkv", "detect_version", "model_config", "read_checkpoint", "to_params"]
