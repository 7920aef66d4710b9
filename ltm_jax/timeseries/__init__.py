"""Time-series models on the library's layers: real-valued series embedded per step or patch, any layer pattern of
the decoder's mixers run over time, a spectrum branch, pooling and classification or regression heads."""
