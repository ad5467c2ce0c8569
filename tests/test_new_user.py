"""What a new user meets first: the install line, the CLI's usage and help, model names
(bundled, misspelt, Hub ids from an offline cache), and vLLM-named metrics."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.loader.hub import bundled_models, resolve_model_path
from tests.server_utils import REPO_ROOT, RemoteServer, metrics


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minivllm.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
        timeout=300,
    )


def test_readme_and_ci_install_torch_from_the_cpu_index() -> None:
    """The README's install line is the one CI runs, and it names the CPU wheel index
    (plain `pip install torch` pulls the CUDA build on an ordinary Linux machine)."""
    script = (REPO_ROOT / "scripts" / "install.sh").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in script
    assert "scripts/install.sh" in (REPO_ROOT / ".ci" / "run").read_text()
    assert "scripts/install.sh" in (REPO_ROOT / "README.md").read_text()


def test_unknown_serve_flag_prints_serves_usage() -> None:
    out = run_cli("serve", "--bogus-flag")
    assert out.returncode == 2
    assert "usage: minivllm serve" in out.stderr
    assert "unrecognized arguments: --bogus-flag" in out.stderr


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from minivllm.entrypoints import cli\n"
        "try:\n"
        "    cli.main(['serve', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch' in sys.modules, file=sys.stderr)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=120,
    )
    assert "--revision" in out.stdout and "--tool-call-parser" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "False"


def test_models_command_lists_the_bundled_models() -> None:
    out = run_cli("models")
    assert out.returncode == 0
    listed = dict(line.split("\t") for line in out.stdout.strip().splitlines())
    assert listed == bundled_models() and "demo-base" in listed
    assert all(Path(p, "config.json").is_file() for p in listed.values())


def test_model_name_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="did you mean 'demo-base'"):
        resolve_model_path("demo-bsae")
    with pytest.raises(ValueError, match="without config.json"):
        resolve_model_path(str(tmp_path))
    assert resolve_model_path(str(tmp_path), need_config=False) == str(tmp_path)


def make_hub_cache(hf_home: Path, repo: str, source: Path, commit: str, ref: str = "main") -> None:
    """huggingface_hub's cache layout, by hand: blobs, a snapshot of links, a ref."""
    root = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for f in source.iterdir():
        blob = root / "blobs" / f"{commit[:8]}-{f.name}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)


def test_hub_ids_resolve_from_an_offline_cache(
    tmp_path: Path, qwen3_dir: Path, make_checkpoint
) -> None:
    """Two revisions of one repo id in a hand-made cache; HF_HUB_OFFLINE=1 means no network.
    The engine run by id (and by --revision) answers as the directory it was copied from."""
    other = make_checkpoint("Qwen3ForCausalLM", seed=5)
    hf_home = tmp_path / "hf"
    make_hub_cache(hf_home, "acme/tiny", qwen3_dir, "a" * 40)
    make_hub_cache(hf_home, "acme/tiny", other, "b" * 40, ref="v2")
    # one process runs the four engines (a process each cost ~6 s of imports)
    code = (
        "import sys\n"
        "from minivllm import LLM, SamplingParams\n"
        "for name, revision in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        "    llm = LLM(name, revision=revision or None, dtype='float32',\n"
        "              kv_cache_memory_bytes=1 << 22)\n"
        "    out = llm.generate([{'prompt_token_ids': [5, 6, 7]}],\n"
        "                       SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)\n"
        "    print(llm.llm_engine.config.model.model)\n"
        "    print(out[0].outputs[0].token_ids)\n"
        "    llm.llm_engine.shutdown()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HOME": str(hf_home)}
    env["HF_HUB_OFFLINE"] = "1"
    runs = [("acme/tiny", ""), ("acme/tiny", "v2"), (str(qwen3_dir), ""), (str(other), "")]
    out = subprocess.run(
        [sys.executable, "-c", code, *(arg for run in runs for arg in run)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()[-8:]
    (path_main, tokens_main), (path_v2, tokens_v2) = lines[0:2], lines[2:4]
    tokens_dir, tokens_other = lines[5], lines[7]
    assert path_main.endswith("a" * 40) and path_v2.endswith("b" * 40)
    assert lines[4] == str(qwen3_dir) and lines[6] == str(other)
    assert tokens_main == tokens_dir and tokens_v2 == tokens_other
    assert tokens_main != tokens_v2
    # an id that is not cached, offline: a clear error, not a traceback from deep inside
    out = run_cli("serve", "acme/absent", env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    assert out.returncode != 0
    assert re.search(r"not in the cache .*HF_HUB_OFFLINE is set", out.stderr), out.stderr[-2000:]


def test_metrics_vllm_alias(qwen3_dir: Path, tmp_path: Path) -> None:
    server = RemoteServer(
        qwen3_dir,
        ["--dtype", "float32", "--kv-cache-memory-bytes", "1MiB", "--metrics-vllm-alias"],
        tmp_path / "alias.log",
    )
    try:
        server.wait_ready()
        samples = metrics(server)
    finally:
        assert server.stop() == 0
    ours = {k for k in samples if k.startswith("minivllm:")}
    assert ours and {k.replace("minivllm:", "vllm:", 1) for k in ours} <= set(samples)
    assert samples["vllm:num_requests_running"] == samples["minivllm:num_requests_running"]


def test_auto_dtype_on_cpus_without_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 checkpoints run in float32 where the CPU has no bf16 arithmetic, unless asked."""
    import torch
    from transformers import Qwen3Config

    from minivllm import config

    hf = Qwen3Config(dtype="bfloat16")
    monkeypatch.setattr(config, "_cpu_has_bf16", lambda: False)
    assert config.resolve_dtype("auto", hf, "cpu") == torch.float32
    assert config.resolve_dtype("bfloat16", hf, "cpu") == torch.bfloat16
    monkeypatch.setattr(config, "_cpu_has_bf16", lambda: True)
    assert config.resolve_dtype("auto", hf, "cpu") == torch.bfloat16


def test_shutdown_frees_weights_and_kv_without_the_cyclic_collector(qwen3_dir: Path) -> None:
    """Engines built one after another in one process (a notebook, a benchmark) must not
    keep the previous ones' memory until Python's cyclic collector happens to run."""
    import gc
    import weakref

    from minivllm import LLM

    gc.collect()
    gc.disable()
    try:
        spec = {"method": "draft_model", "model": str(qwen3_dir), "num_speculative_tokens": 2}
        llm = LLM(
            str(qwen3_dir),
            dtype="float32",
            kv_cache_memory_bytes=1 << 22,
            speculative_config=spec,
        )
        runner = llm.llm_engine.executor.runner
        refs = [
            weakref.ref(runner.model),
            weakref.ref(runner.attention_layers[0].kv_cache),
            weakref.ref(runner.spec_decoder.proposer),
        ]
        del runner
        llm.llm_engine.shutdown()
        assert [r() is None for r in refs] == [True, True, True]
    finally:
        gc.enable()
