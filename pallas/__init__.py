"""Pallas GPU kernels (no model knowledge): flash attention, WKV-4, WKV-7 (sequential and chunked) and the quantised
matmul."""
