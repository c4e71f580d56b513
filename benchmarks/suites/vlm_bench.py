"""Images through a vision-language model: images/s and TTFT at concurrency 1 and 8,
shardserve (``/v1/chat/completions`` with a base64 PNG, streamed) against ``transformers``
``generate()`` on the same images and prompts, in one run.

Two families (``--family llava|qwen2_5_vl|all``). LLaVA: a small random
``LlavaForConditionalGeneration`` (CLIP tower: 6 layers,
hidden 256, 112-pixel images in 14-pixel patches = 64 image tokens; Llama: 6 layers,
hidden 512), float32, built once under ``benchmarks/.cache``. Qwen2.5-VL: a small random
``Qwen2_5_VLForConditionalGeneration`` of the same language-model shape, dynamic resolution,
99 image tokens per bench image (:mod:`benchmarks.suites.qwen_vl_bench`). Each request is one
distinct image (no cache hits) plus a short question and 32 greedy output tokens, EOS ignored.
shardserve runs tp=1 on CPU; ``generate()`` runs padded batches of ``c`` requests in this
process after the server has stopped (its TTFT: a batch's ``max_new_tokens=1`` call).

``python -m benchmarks suites vlm_bench --requests 4 [--family …]`` runs these rows alone (the
tiny-scale check), printing a table; ``make bench`` adds both families' rows as notes
(:func:`run_vlm`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import numpy as np
from PIL import Image

from benchmarks.harness import servers
from benchmarks.harness.bench import Bench
from benchmarks.harness.paths import CACHE
from benchmarks.suites import qwen_vl_bench

MODEL_DIR = CACHE / "llava-bench-v1"
IMAGE_TOKEN = "<image>"
QUESTION = "Describe the picture in detail."
OUTPUT_LEN = 32
CONCURRENCIES = (1, 8)
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}USER: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def ensure_model(path: Path = MODEL_DIR) -> Path:
    """The random bench LLaVA (see the module docstring), built once."""
    if (path / "preprocessor_config.json").is_file():
        return path
    import torch
    import transformers
    from tokenizers import AddedToken

    from model_shards.launch.default_model import build_tokenizer, tokenizer_config

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    vision = transformers.CLIPVisionConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=8,
        image_size=112,
        patch_size=14,
    )
    text = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=tokenizer.get_vocab_size(),
        bos_token_id=0,
        eos_token_id=1,
        max_position_embeddings=1024,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.get_vocab_size() - 1,  # the token just added
        image_seq_length=64,
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    tok_config = {**tokenizer_config(1024), "chat_template": TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": 112}, crop_size={"height": 112, "width": 112}
    )
    processor.save_pretrained(path)
    return path


def images(n: int) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (120, 140, 3), dtype=np.uint8)) for _ in range(n)]


def _png_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def _one(client: httpx.AsyncClient, url: str) -> float:
    """One streamed request; seconds to its first content delta."""
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": OUTPUT_LEN,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start, first = time.perf_counter(), None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            text = line.startswith("data: {") and '"content":"' in line
            if first is None and text and '"content":""' not in line:
                first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


async def _ours_point(base_url: str, urls: list[str], c: int) -> dict[str, float]:
    gate = asyncio.Semaphore(c)

    async def run(client: httpx.AsyncClient, url: str) -> float:
        async with gate:
            return await _one(client, url)

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await _one(client, urls[0])  # warm-up
        start = time.perf_counter()
        ttfts = await asyncio.gather(*(run(client, u) for u in urls))
        wall = time.perf_counter() - start
    return {"images_per_s": len(urls) / wall, "ttft_ms": 1000 * statistics.median(ttfts)}


def _hf_point(model_dir: Path, imgs: list[Image.Image], c: int) -> dict[str, float]:
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": f"{IMAGE_TOKEN}\n{QUESTION}"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = str(text).replace(IMAGE_TOKEN, IMAGE_TOKEN * 64)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    batches = [imgs[i : i + c] for i in range(0, len(imgs), c)]
    walls: list[float] = []
    ttfts: list[float] = []
    with torch.no_grad():
        for batch in [batches[0], *batches]:  # the first batch twice: a warm-up
            pixels = processor(images=batch, return_tensors="pt")["pixel_values"]
            input_ids = torch.tensor([ids] * len(batch))
            for new, out in ((1, ttfts), (OUTPUT_LEN, walls)):
                start = time.perf_counter()
                model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    pixel_values=pixels,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                )
                out.append(time.perf_counter() - start)
    walls, ttfts = walls[1:], ttfts[1:]
    return {"images_per_s": len(imgs) / sum(walls), "ttft_ms": 1000 * statistics.median(ttfts)}


class Family(NamedTuple):
    """One bench model: its label, builder, images and ``generate()`` point."""

    label: str
    ensure_model: Callable[[], Path]
    images: Callable[[int], list[Image.Image]]
    hf_point: Callable[[Path, list[Image.Image], int], dict[str, float]]


FAMILIES = {
    "llava": Family("LLaVA", ensure_model, images, _hf_point),
    "qwen2_5_vl": Family(
        "Qwen2.5-VL", qwen_vl_bench.ensure_model, qwen_vl_bench.images, qwen_vl_bench.hf_point
    ),
}


def measure(requests_per_c: int, family: str = "llava") -> list[dict[str, Any]]:
    """Both systems at each concurrency, ``requests_per_c * c`` requests per point."""
    fam = FAMILIES[family]
    model_dir = fam.ensure_model()
    rows: list[dict[str, Any]] = []
    points = {c: fam.images(max(requests_per_c, requests_per_c * c)) for c in CONCURRENCIES}
    log = CACHE / "logs" / f"vlm-{family}-shardserve.log"
    command = servers.serve_argv(model_dir, dtype="float32", device="cpu", port=0)
    with servers.running(command, log) as base_url:
        for c, imgs in points.items():
            result = asyncio.run(_ours_point(base_url, [_png_url(i) for i in imgs], c))
            rows.append({"family": family, "system": "shardserve", "concurrency": c, **result})
    for c, imgs in points.items():
        result = fam.hf_point(model_dir, imgs, c)
        rows.append({"family": family, "system": "hf-generate", "concurrency": c, **result})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| family | system | conc. | images/s | median TTFT (ms) |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {FAMILIES[r['family']].label} | {r['system']} | {r['concurrency']} "
            f"| {r['images_per_s']:.2f} | {r['ttft_ms']:.0f} |"
        )
    return "\n".join(lines)


def run_vlm(bench: Bench, requests_per_c: int = 4) -> None:
    """The rows of the module docstring, both families, added to ``bench``'s notes."""
    for family, fam in FAMILIES.items():
        for r in measure(requests_per_c, family):
            bench.notes.append(
                f"{fam.label} images ({r['system']}, c={r['concurrency']}): "
                f"{r['images_per_s']:.2f} images/s, median TTFT {r['ttft_ms']:.0f} ms"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the image rows of make bench")
    parser.add_argument("--requests", type=int, default=4, help="requests per unit of c")
    parser.add_argument("--family", choices=[*FAMILIES, "all"], default="all")
    parser.add_argument("--out", default="/tmp/vlm-bench.json")
    args = parser.parse_args(argv)
    families = list(FAMILIES) if args.family == "all" else [args.family]
    rows = [row for family in families for row in measure(args.requests, family)]
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    return 0
