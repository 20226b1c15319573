"""The serving entry points: paged KV caches (decode and chunked prefill) and packed variable-length batches."""
