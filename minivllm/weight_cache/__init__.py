"""Fast Start: a resident daemon keeps a loaded model's final tensors in shared memory, and
engines map them (`load_format="ipc_cache"`) instead of reading the checkpoint again.
Design, trust model and figures: docs/fast-start.md."""
