"""gRPC HealthCheck's answer, from the servicer alone (no server): a dead engine and a
draining server are unhealthy."""

from __future__ import annotations

from types import SimpleNamespace

from minivllm.engine.async_llm import EngineDeadError
from minivllm.entrypoints.grpc.servicer import VllmEngineServicer


def test_health_reflects_a_dead_engine_and_draining() -> None:
    def health(dead: bool, draining: bool) -> tuple[bool, str]:
        fake = SimpleNamespace(
            async_llm=SimpleNamespace(dead_error=EngineDeadError("boom") if dead else None),
            state=SimpleNamespace(is_draining=draining),
        )
        return VllmEngineServicer.health(fake)  # type: ignore[arg-type]

    assert health(dead=False, draining=False) == (True, "healthy")
    assert health(dead=True, draining=False)[0] is False and "boom" in health(True, False)[1]
    assert health(dead=False, draining=True) == (False, "the server is shutting down")
