"""`minivllm serve --grpc`: vLLM's gRPC protocol (`vllm.grpc.engine.VllmEngine`, the stubs
of the `smg-grpc-proto` package) over the same `AsyncLLM` as the HTTP server (docs/grpc.md)."""
