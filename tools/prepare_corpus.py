"""Build the demo-model text corpus from the Debian ``python3.11-doc`` package.

The Python documentation ships its reStructuredText sources as
``/usr/share/doc/python3.11/html/_sources/**/*.rst.txt``. This script turns
them into plain English text (markup roles unwrapped, directives and labels
dropped, code examples kept) and splits whole documents deterministically into
``train.txt`` and ``heldout.txt``; documents are separated by a line holding
only ``<|endoftext|>``. ``SOURCE.md`` records where the text came from, its
licence, and a checksum of every output file
(also in ``manifest.json``).

    apt-get install -y python3.11-doc
    python tools/prepare_corpus.py --out out/corpus
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SRC = Path("/usr/share/doc/python3.11/html/_sources")
DOC_SEPARATOR = "\n<|endoftext|>\n"
HELDOUT_EVERY = 20  # one document in ~20 goes to held-out, chosen by path hash
SKIPPED = {"license.rst.txt", "copyright.rst.txt", "contents.rst.txt", "whatsnew/changelog.rst.txt"}

# Directives whose argument is the interesting part (an API signature).
SIGNATURE_DIRECTIVES = {
    "function",
    "method",
    "class",
    "attribute",
    "data",
    "exception",
    "decorator",
    "classmethod",
    "staticmethod",
    "coroutinemethod",
    "coroutinefunction",
    "abstractmethod",
    "c:function",
    "c:member",
    "c:type",
    "c:var",
    "c:macro",
    "cmdoption",
    "envvar",
    "opcode",
    "describe",
    "pdbcommand",
    "option",
}
# Directives dropped together with their indented body.
DROPPED_DIRECTIVES = {
    "index",
    "toctree",
    "highlight",
    "sectionauthor",
    "moduleauthor",
    "include",
    "literalinclude",
    "currentmodule",
    "tabularcolumns",
    "testsetup",
    "testcleanup",
    "only",
    "raw",
    "productionlist",
    "availability",
    "audit-event",
    "program",
    "module",
    "image",
    "figure",
    "changelog",
    "csv-table",
    "list-table",
    "grammar-snippet",
    "limited-api-list",
}
VERSION_DIRECTIVES = {
    "versionadded": "New in version {}.",
    "versionchanged": "Changed in version {}.",
    "deprecated": "Deprecated since version {}.",
    "deprecated-removed": "Deprecated since version {}.",
}

DIRECTIVE_RE = re.compile(r"^\.\.\s+([\w:-]+)::\s*(.*)$")
ADORNMENT_RE = re.compile(r"^\s*([=\-*~^\"#+`'.:_])\1{3,}\s*$")
TABLE_RULE_RE = re.compile(r"^\s*(\+[-=+]+\+|=+( +=+)+)\s*$")
ROLE_RE = re.compile(r":[\w:.-]+:`([^`]+)`")
LINK_RE = re.compile(r"`([^`<]+?)\s*<[^`>]+>`_{1,2}")
REF_RE = re.compile(r"`([^`]+)`_{1,2}")
LITERAL_RE = re.compile(r"``([^`]+)``")
STRONG_RE = re.compile(r"\*\*([^*\s][^*]*?)\*\*")


@dataclass(frozen=True, slots=True)
class Document:
    """One cleaned documentation page."""

    rel_path: str
    text: str

    @property
    def is_heldout(self) -> bool:
        digest = hashlib.sha256(self.rel_path.encode()).digest()
        return digest[0] % HELDOUT_EVERY == 0


def _role_text(body: str) -> str:
    """``~os.path.join`` -> ``join``; ``title <target>`` -> ``title``; ``!x`` -> ``x``."""
    body = re.sub(r"\s*<[^>]*>$", "", body)
    if body.startswith("~"):
        body = body[1:].rsplit(".", 1)[-1]
    return body.lstrip("!")


def clean_inline(line: str) -> str:
    line = ROLE_RE.sub(lambda m: _role_text(m.group(1)), line)
    line = LINK_RE.sub(r"\1", line)
    line = REF_RE.sub(r"\1", line)
    line = LITERAL_RE.sub(r"\1", line)
    line = STRONG_RE.sub(r"\1", line)
    line = line.replace("|release|", "3.11").replace("|version|", "3.11")
    if line.rstrip().endswith("::"):
        line = line.rstrip()[:-1]
    return line.rstrip()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _take_block(lines: list[str], start: int, indent: int) -> int:
    """Return the index after the block of lines indented deeper than ``indent``."""
    end = start
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return end


def _directive_head(name: str, arg: str) -> list[str]:
    if name in SIGNATURE_DIRECTIVES and arg:
        return [clean_inline(arg), ""]
    if name in VERSION_DIRECTIVES and arg:
        version, _, note = arg.partition(" ")
        head = VERSION_DIRECTIVES[name].format(version.rstrip(","))
        return [f"{head} {clean_inline(note)}".strip()]
    if name == "rubric" and arg:
        return [clean_inline(arg), ""]
    return []


def _directive_body(block: list[str]) -> list[str]:
    body = [line for line in block if not re.match(r"^\s*:[\w-]+:( |$)", line)]
    return clean_lines(textwrap.dedent("\n".join(body)).split("\n"))


def clean_lines(lines: list[str]) -> list[str]:
    """Strip reST markup from ``lines``; directives recurse into their bodies."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        indent = _indent(line)
        if stripped == ".." or stripped.startswith(".. "):
            end = _take_block(lines, i + 1, indent)
            match = DIRECTIVE_RE.match(stripped)
            if match and match.group(1) not in DROPPED_DIRECTIVES:
                head = _directive_head(match.group(1), match.group(2))
                body = _directive_body(lines[i + 1 : end])
                out.extend(" " * indent + text if text else "" for text in head + body)
            i = end
            continue
        if stripped == "::" or ADORNMENT_RE.match(line) or TABLE_RULE_RE.match(line):
            i += 1
            continue
        out.append(clean_inline(line))
        i += 1
    return out


def squeeze_blank_lines(lines: list[str]) -> str:
    text = "\n".join(lines).strip()
    return re.sub(r"\n{3,}", "\n\n", text)


def load_documents(src: Path) -> list[Document]:
    docs = []
    for path in sorted(src.rglob("*.rst.txt")):
        rel_path = path.relative_to(src).as_posix()
        if rel_path in SKIPPED:
            continue
        text = squeeze_blank_lines(clean_lines(path.read_text(encoding="utf-8").splitlines()))
        if len(text) >= 200:
            docs.append(Document(rel_path, text))
    return docs


def package_version(package: str) -> str:
    result = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True
    )
    return result.stdout.strip() or "unknown"


def write_split(path: Path, docs: list[Document]) -> str:
    data = DOC_SEPARATOR.join(doc.text for doc in docs) + "\n"
    path.write_text(data, encoding="utf-8")
    return hashlib.sha256(data.encode()).hexdigest()


def write_source_note(
    out: Path, splits: dict[str, list[Document]], digests: dict[str, str]
) -> None:
    rows = "\n".join(
        f"| {name}.txt | {len(docs)} | {sum(len(d.text) for d in docs):,} | `{digests[name][:16]}` |"
        for name, docs in splits.items()
    )
    heldout = ", ".join(doc.rel_path for doc in splits["heldout"])
    note = f"""# Demo corpus

Source: Debian package `python3.11-doc` {package_version("python3.11-doc")}
(`{DEFAULT_SRC}`), the reStructuredText sources of the Python 3.11
documentation, converted to plain text by `tools/prepare_corpus.py`.

Licence: the Python documentation is licensed under the PSF License Agreement
(Python Software Foundation License Version 2); code examples in it are also
available under the Zero-Clause BSD licence. Copyright 2001-2023 Python Software
Foundation. See `/usr/share/doc/python3.11/copyright`.

| file | documents | characters | sha256 |
|---|---|---|---|
{rows}

Held-out documents: {heldout}
"""
    (out / "SOURCE.md").write_text(note, encoding="utf-8")
    manifest = {
        "package": "python3.11-doc",
        "version": package_version("python3.11-doc"),
        "licence": "PSF-2.0",
        **{f"{name}_documents": len(docs) for name, docs in splits.items()},
        **{f"{name}_sha256": digest for name, digest in digests.items()},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, default=DEFAULT_SRC)
    parser.add_argument("--out", type=Path, default=Path("out/corpus"))
    args = parser.parse_args()
    if not args.src.is_dir():
        raise SystemExit(f"{args.src} missing: run `apt-get install -y python3.11-doc`")
    docs = load_documents(args.src)
    splits = {
        "train": [doc for doc in docs if not doc.is_heldout],
        "heldout": [doc for doc in docs if doc.is_heldout],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    digests = {name: write_split(args.out / f"{name}.txt", split) for name, split in splits.items()}
    write_source_note(args.out, splits, digests)
    for name, split in splits.items():
        print(f"{name}: {len(split)} documents, {sum(len(d.text) for d in split):,} chars")


if __name__ == "__main__":
    main()
