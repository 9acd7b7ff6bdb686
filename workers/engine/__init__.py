"""The engine core: scheduler, KV cache, sampler and output processor; no Redis, no RQ."""
