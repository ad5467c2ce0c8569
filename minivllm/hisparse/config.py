"""HiSparse's configuration, read the way vLLM v0.30 reads it.

HiSparse is switched on by its KV connector (vLLM #57041 infers the rest):

    kv_transfer_config={"kv_connector": "HiSparseConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"host_pool_gib": 8}}

(also as a child of a "MultiConnector"). Optional tuning comes through
`attention_config={"hisparse_config": {"device_buffer_size": ..., "eager_host_mirror": ...}}`
and is refused without the connector. minivllm adds one extra-config key,
`host_pool_file`: back the host pool by a memory-mapped file at that path on local disk
(created, and removed again as soon as every rank has mapped it), so a CPU box can hold
contexts larger than its RAM budget.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from minivllm.utils.json_config import config_dict

CONNECTOR = "HiSparseConnector"
_CONNECTOR_FIELDS = {"kv_connector", "kv_role", "kv_connector_extra_config", "engine_id"}
_EXTRA_FIELDS = {"host_pool_gib", "host_pool_file"}
_TUNING_FIELDS = {"device_buffer_size", "eager_host_mirror"}


@dataclass(frozen=True)
class HiSparseConfig:
    host_pool_gib: float
    host_pool_file: str | None = None
    # hot-buffer rows per host-backed request and layer; None: (decode_query_len + 1) x index_topk
    device_buffer_size: int | None = None
    # copy each page to the host pool as soon as it is full, so a later spill moves no data
    eager_host_mirror: bool = True
    # names this engine's shared pool file in /dev/shm when TP ranks of a node share it
    pool_id: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.host_pool_gib, int | float) or self.host_pool_gib <= 0:
            raise ValueError(f"host_pool_gib must be a number > 0, got {self.host_pool_gib!r}")
        if self.device_buffer_size is not None and (
            not isinstance(self.device_buffer_size, int) or self.device_buffer_size < 1
        ):
            raise ValueError(
                f"hisparse_config.device_buffer_size must be an integer >= 1, "
                f"got {self.device_buffer_size!r}"
            )
        if not isinstance(self.eager_host_mirror, bool):
            raise TypeError("hisparse_config.eager_host_mirror must be true or false")

    def shared_path(self, ranks_per_node: int) -> str | None:
        """The file the TP ranks of one node map their common pool from (None: one rank)."""
        if self.host_pool_file is not None or ranks_per_node == 1:
            return None
        return f"/dev/shm/minivllm-hisparse-{self.pool_id}"

    def buffer_rows(self, decode_query_len: int, index_topk: int) -> int:
        """Hot rows per request and layer: the default, or the tuned size if it can hold
        one step's selection (every query row of a verification may pick other tokens)."""
        least = decode_query_len * index_topk
        if self.device_buffer_size is None:
            return (decode_query_len + 1) * index_topk
        if self.device_buffer_size < least:
            raise ValueError(
                f"hisparse_config.device_buffer_size={self.device_buffer_size} cannot hold one "
                f"step's selection: at least {decode_query_len} x index_topk={index_topk} = {least}"
            )
        return self.device_buffer_size


def _find_connector(config: dict[str, Any]) -> dict[str, Any] | None:
    kind = config.get("kv_connector")
    if kind == CONNECTOR:
        return config
    if kind == "MultiConnector":
        extra = config.get("kv_connector_extra_config") or {}
        children = extra.get("connectors") or []
        found = [c for c in children if isinstance(c, dict) and c.get("kv_connector") == CONNECTOR]
        others = [c.get("kv_connector") for c in children if c not in found]
        if others:
            raise ValueError(
                f"minivllm has no KV connector {others[0]!r}; of MultiConnector's children it "
                f"runs only {CONNECTOR}"
            )
        return found[0] if found else None
    raise ValueError(
        f"minivllm has no KV connector {kind!r}; the one it runs is {CONNECTOR} "
        '(kv_transfer_config={"kv_connector": "HiSparseConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"host_pool_gib": N}})'
    )


def resolve_hisparse_config(
    kv_transfer_config: dict[str, Any] | str | None,
    attention_config: dict[str, Any] | str | None,
    hf_config: Any,
) -> HiSparseConfig | None:
    """HiSparse's settings from the two engine arguments, or None when it is off."""
    tuning: dict[str, Any] = {}
    if attention_config is not None:
        attention = config_dict(attention_config, "attention_config", {"hisparse_config"})
        tuning = config_dict(
            attention.get("hisparse_config") or {}, "hisparse_config", _TUNING_FIELDS
        )
        if "hisparse_config" in attention and kv_transfer_config is None:
            raise ValueError(
                "hisparse_config tunes HiSparse, which is off: enable it with "
                'kv_transfer_config={"kv_connector": "HiSparseConnector", "kv_role": "kv_both", '
                '"kv_connector_extra_config": {"host_pool_gib": N}}'
            )
    if kv_transfer_config is None:
        return None
    transfer = config_dict(kv_transfer_config, "kv_transfer_config", _CONNECTOR_FIELDS)
    connector = _find_connector(transfer)
    if connector is None:
        if tuning:
            raise ValueError(f"hisparse_config needs {CONNECTOR} among the KV connectors")
        return None
    role = connector.get("kv_role", "kv_both")
    if role != "kv_both":
        raise ValueError(f"{CONNECTOR} runs with kv_role 'kv_both', got {role!r}")
    extra = config_dict(
        connector.get("kv_connector_extra_config") or {}, "kv_connector_extra_config", _EXTRA_FIELDS
    )
    if "host_pool_gib" not in extra:
        raise ValueError(
            f"{CONNECTOR} needs kv_connector_extra_config.host_pool_gib: the host pool's size"
        )
    if not getattr(hf_config, "index_topk", None):
        arch = (getattr(hf_config, "architectures", None) or ["this model"])[0]
        raise ValueError(
            f"HiSparse serves sparse-attention models (DeepSeek-V3.2's DSA, with an indexer "
            f"and index_topk); {arch} has none, so every token is attended and nothing can "
            "live off the device"
        )
    return HiSparseConfig(
        extra["host_pool_gib"],
        extra.get("host_pool_file"),
        tuning.get("device_buffer_size"),
        tuning.get("eager_host_mirror", True),
        uuid.uuid4().hex[:16],
    )
