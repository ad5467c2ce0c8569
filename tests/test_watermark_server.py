"""Watermarking end to end: `minivllm serve --watermark-config ... --watermark-enforce
--watermark-public-detection` with the real `openai` client, the detection route, and the
`minivllm watermark detect` CLI in a subprocess."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys

import httpx
import openai
import pytest

from tests.server_utils import REPO_ROOT, RemoteServer, assert_error, post

SECRET = "8675309"
API_KEY = "sk-wm-test"
CONFIG = json.dumps({"key_env": "WM_TEST_KEY", "algorithm": "gumbel"})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    os.environ["WM_TEST_KEY"] = SECRET
    try:
        srv = RemoteServer(
            "demo-base",
            [
                "--dtype",
                "float32",
                "--watermark-config",
                CONFIG,
                "--watermark-enforce",
                "--watermark-public-detection",
                "--api-key",
                API_KEY,
            ],
            tmp_path_factory.mktemp("wm") / "server.log",
        ).wait_ready()
    finally:
        del os.environ["WM_TEST_KEY"]
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _detect(server, body, headers=None) -> httpx.Response:
    return httpx.post(server.url + "/v1/watermark/detect", json=body, headers=headers or {})


def test_streamed_completions_are_watermarked_and_detected(server, client):
    texts = []
    for prompt in ("The for statement in Python", "A dictionary is"):
        stream = client.completions.create(
            model="demo-base",
            prompt=prompt,
            max_tokens=150,
            temperature=1.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        texts.append("".join(chunk.choices[0].text for chunk in stream))
    chat = client.chat.completions.create(
        model="demo-base",
        messages=[{"role": "user", "content": "Describe the os module."}],
        max_tokens=150,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    texts.append(chat.choices[0].message.content)
    for text in texts:
        response = _detect(server, {"text": text})  # public: no API key needed
        assert response.status_code == 200, response.text
        result = response.json()
        assert set(result) == {
            "score",
            "p_value",
            "log10_p_value",
            "z_score",
            "num_scored_tokens",
            "is_watermarked",
        }
        assert result["is_watermarked"] and result["num_scored_tokens"] > 50
        assert SECRET not in response.text
    # unwatermarked text is not flagged
    plain = " ".join(["the file object is returned by the function"] * 3)
    assert not _detect(server, {"text": plain}).json()["is_watermarked"]
    assert SECRET not in server.log()


def test_enforcement_refuses_the_opt_out(server, client):
    for route, body in (
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "watermarking": False}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "watermarking": False},
        ),
    ):
        response = post(server, route, body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert_error(response, 400, "--watermark-enforce")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model="demo-base", prompt="Hi", max_tokens=3, extra_body={"watermarking": False}
        )
    # opting in explicitly is fine
    out = client.completions.create(
        model="demo-base", prompt="Hi", max_tokens=3, extra_body={"watermarking": True}
    )
    assert out.choices[0].text is not None


def test_the_detection_route_validates_and_the_rest_still_needs_the_key(server):
    assert_error(_detect(server, {}), 400, "exactly one")
    assert_error(_detect(server, {"text": "a", "token_ids": [1]}), 400, "exactly one")
    assert_error(_detect(server, {"token_ids": [1, 10**6]}), 400, "out of vocabulary")
    assert_error(_detect(server, {"text": "a", "p_value_threshold": 2}), 400)
    assert_error(httpx.get(server.url + "/v1/models"), 401)
    result = _detect(server, {"token_ids": []}).json()
    assert result["num_scored_tokens"] == 0 and result["p_value"] == 1.0


def _cli(args: list[str], stdin: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "WM_TEST_KEY": SECRET}
    return subprocess.run(
        [sys.executable, "-m", "minivllm.entrypoints.cli", "watermark", "detect", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
    )


def test_the_cli_detects_from_stdin_with_exit_status(client, monkeypatch, capsys, caplog):
    text = (
        client.completions.create(
            model="demo-base",
            prompt="To open a file for reading,",
            max_tokens=150,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    # the command itself once (its exit status and stdout)
    marked = _cli(["--watermark-config", CONFIG, "--tokenizer", "demo-base", "--json"], text)
    assert marked.returncode == 0, marked.stderr
    assert json.loads(marked.stdout)["is_watermarked"] is True
    # the other outcomes through the CLI's main in this process (a command's start imports
    # torch and transformers, ~5 s each here); its log handler left out for caplog
    from minivllm.entrypoints import cli

    monkeypatch.setattr(cli, "setup_logging", lambda: None)
    monkeypatch.setattr(logging.getLogger("minivllm"), "propagate", True)
    monkeypatch.setenv("WM_TEST_KEY", SECRET)
    detect = ["watermark", "detect", "--watermark-config"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert cli.main([*detect, '{"key": 12345}', "--tokenizer", "demo-base"]) == 1
    assert "not watermarked" in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    with caplog.at_level(logging.ERROR, logger="minivllm"):
        assert cli.main([*detect, '{"key": "oops"}']) == 2
    assert "integer key" in caplog.text
