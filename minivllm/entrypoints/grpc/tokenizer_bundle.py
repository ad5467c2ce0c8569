"""`GetTokenizer`: the tokenizer's files as one zip archive, streamed in chunks, the last of
which carries the archive's sha256 (smg's `common.proto`), so a gateway can rebuild the
tokenizer without the model's directory."""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

from smg_grpc_proto.generated import common_pb2

CHUNK_BYTES = 64 * 1024  # what the gateway's gRPC client reads per message
# What vLLM's servicer ships: the tokenizer, its configs and chat templates.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)
TOKENIZER_GLOBS = ("*.jinja", "*.tiktoken", "*.model")


class TokenizerBundle:
    """One directory's archive, built off the event loop on first use and kept."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self._archive: tuple[bytes, str] | None = None
        self._building = asyncio.Lock()

    async def archive(self) -> tuple[bytes, str]:
        """The zip's bytes and their sha256 hex digest; FileNotFoundError if there are no files."""
        async with self._building:
            if self._archive is None:
                self._archive = await asyncio.to_thread(build_archive, self.directory)
        return self._archive


def build_archive(directory: Path) -> tuple[bytes, str]:
    names = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    for pattern in TOKENIZER_GLOBS:
        names += sorted(p.name for p in directory.glob(pattern) if p.is_file())
    names = list(dict.fromkeys(names))
    if not names:
        raise FileNotFoundError("the tokenizer directory has no tokenizer files")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            archive.write(directory / name, name)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes, sha256: str) -> Iterator[common_pb2.GetTokenizerChunk]:
    """At most `CHUNK_BYTES` each, in order; only the last carries the digest."""
    for start in range(0, len(data), CHUNK_BYTES):
        end = min(start + CHUNK_BYTES, len(data))
        yield common_pb2.GetTokenizerChunk(
            data=data[start:end], sha256=sha256 if end == len(data) else ""
        )
