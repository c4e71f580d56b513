"""Qwen2-VL / Qwen2.5-VL media in the frontend: preprocessing and the prompt's vision tokens.

* ``image.py``: ``smart_resize``, rescale, normalise, patches and ``grid_thw`` of an image;
* ``video.py``: the sampled frames of a video to patches and their grid (torch, first video);
* ``prompt.py``: ``QwenVLIntake``: vision token ids checked, each pad expanded to its run.

Each equals transformers' processor step for step (``Qwen2VLImageProcessor``,
``Qwen2VLVideoProcessor``, ``Qwen2_5_VLProcessor``) without importing transformers; torch is
imported only when the first video arrives. The checkpoint's fields come from
:mod:`model_shards.config.qwen2_5_vl`; M-RoPE positions and the tower run on the ranks
(``model_shards/models/qwen2_5_vl/``).
"""
