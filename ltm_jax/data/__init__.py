"""Data: the byte tokenizer, corpora (embedded Python documentation or user files) and batch loaders."""

from ltm_jax.data.corpus import Splits, check_model_reads, load_splits
from ltm_jax.data.embedded import embedded_corpus, embedded_corpus_stats, embedded_documents
from ltm_jax.data.loader import DocumentLoader, TrainLoader, eval_batches
from ltm_jax.data.sources import TokenSource, open_source
from ltm_jax.data.tokenizer import ByteTokenizer, get_tokenizer

__all__ = [
    "ByteTokenizer",
    "DocumentLoader",
    "Splits",
    "TrainLoader",
    "check_model_reads",
    "embedded_corpus",
    "embedded_corpus_stats",
    "embedded_documents",
    "eval_batches",
    "get_tokenizer",
    "load_splits",
    "open_source",
    "TokenSource",
]
