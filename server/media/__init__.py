"""Images and videos in chat prompts, from a message's parts to pixels in ``GenerateRequest.media``.

* ``parts.py``: ``image_url`` / ``video_url`` parts taken out of a message, a marker left behind;
* ``fetch.py``: a part's bytes (``data:``, ``file://``, http(s)); decode an image; the options;
* ``http_fetch.py``: http(s) URLs fetched without reaching inside the network (public
  addresses, checked redirects, the allow-list, one deadline, one generic error);
* ``budget.py``: pixel caps after the model's resize, the per-request decoded-bytes budget;
* ``image.py``: CLIP preprocessing exactly as ``preprocessor_config.json`` says (LLaVA);
* ``video.py``: ``video_url`` parts decoded with PyAV into frames at ``--video-fps``, capped;
* ``multimodal.py``: which models take media and how, the media flags, placeholders expanded;
* ``qwen2_5_vl/``: Qwen2.5-VL's image and video preprocessing and prompt expansion.

Every bad input is a 400 naming its part; decoding runs in worker threads, never on the event
loop. Preprocessing matches transformers' without importing it, and happens here: the ranks get
pixels and a content hash per item, never the frontend's media flags.
"""
