"""HiSparse: a host-memory KV tier under DeepSeek sparse attention (vLLM v0.30.0).

`config` reads the connector settings, `coordinator` spills pages on the scheduler
side, `runtime` copies them and resolves top-k selections through hot buffers on the
runner side, `host_pool` is the host tier's one allocation.
"""
