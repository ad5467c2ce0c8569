"""`minivllm watermark detect`: score a completion for a watermark config's key."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

logger = logging.getLogger("minivllm")


def add_parser(commands: Any, default_tokenizer: str) -> None:
    watermark = commands.add_parser(
        "watermark",
        help="check texts for a watermark",
        description="Watermark tools (docs/watermarking.md).",
    )
    sub = watermark.add_subparsers(dest="watermark_command", metavar="COMMAND")
    sub.required = True
    detect = sub.add_parser(
        "detect",
        help="test whether a completion carries a key's watermark",
        description="Score a completion (not its prompt) under the watermark config; exit "
        "status 0 if watermarked, 1 if not, 2 on bad input.",
    )
    detect.add_argument(
        "file", nargs="?", default="-", help="the completion's text (default: stdin)"
    )
    detect.add_argument(
        "--watermark-config",
        metavar="JSON",
        required=True,
        help="the generation's config (key by key_env or key_file; algorithm, alpha and "
        "context_width must match the generation's)",
    )
    detect.add_argument(
        "--tokenizer",
        default=default_tokenizer,
        help="the model whose tokenizer generated the text (default: %(default)s)",
    )
    detect.add_argument(
        "--token-ids",
        action="store_true",
        help="the input is a JSON list of token ids instead of text",
    )
    detect.add_argument(
        "--threshold",
        type=float,
        default=0.01,
        help="p-value at or below which the text counts as watermarked (default: %(default)s)",
    )
    detect.add_argument(
        "--alpha",
        type=float,
        default=None,
        help="dual key: the weight of key B (default: the config's alpha, generation's); "
        "under speculative decoding the share of key-B tokens is about 1 - the acceptance rate",
    )
    detect.add_argument("--json", action="store_true", help="print the result as JSON")
    detect.set_defaults(handler=detect_command, parser=detect)


def detect_command(args: argparse.Namespace) -> int:
    import json

    from minivllm.watermark.config import WatermarkConfig
    from minivllm.watermark.detector import detect

    try:
        config = WatermarkConfig.from_value(args.watermark_config)
        if args.file == "-":
            data = sys.stdin.read()
        else:
            with open(args.file, encoding="utf-8") as f:
                data = f.read()
        if args.token_ids:
            ids = json.loads(data)
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
            ):
                raise ValueError("--token-ids: the input must be a JSON list of token ids")
        else:
            from transformers import AutoTokenizer

            from minivllm.loader.hub import resolve_model_path

            tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.tokenizer))
            ids = tokenizer(data, add_special_tokens=False).input_ids
        result = detect(ids, config, args.threshold, alpha=args.alpha)
    except (ValueError, TypeError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        verdict = "watermarked" if result.is_watermarked else "not watermarked"
        print(
            f"{verdict}: p = {result.p_value:.3g} (log10 {result.log10_p_value:.1f}), "
            f"z = {result.z_score:.2f}, {result.num_scored_tokens} tokens scored"
        )
    return 0 if result.is_watermarked else 1
