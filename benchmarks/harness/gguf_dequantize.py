"""A GGUF file's weights dequantized into a Hugging Face directory (a subprocess helper)::

    python -m benchmarks harness gguf_dequantize FILE.gguf OUT_DIR

transformers' GGUF loader dequantizes every tensor to float32 (it needs ``accelerate``: run
with ``benchmarks/.cache/pydeps`` on ``PYTHONPATH``). A model loaded that way is marked
GGUF-quantized and refuses ``save_pretrained``, so its weights go into a fresh model of the
same config (strict ``load_state_dict``), which saves as plain float32 safetensors; the
tokenizer (``tokenizer.json``) and chat template are saved beside them.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def dequantize(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    dequantize(args.gguf, args.out)
    return 0
