"""Vision-language models: a tiny random LLaVA checkpoint (built with transformers), parity with
transformers at tp=1 / tp=2 / pp=2, its caches, and a live server taking images."""
