"""A request that leaves a sampling field out takes the model's generation_config.json setting (vLLM's
generation_config="auto"), and one that gives it keeps its own."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx

from .conftest import MODEL_NAME, LiveServer


def test_missing_fields_take_the_models_generation_config(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "greedy-by-default"
    shutil.copytree(tiny_model, path)
    gen = path / "generation_config.json"
    settings = json.loads(gen.read_text()) if gen.exists() else {}
    gen.write_text(json.dumps({**settings, "temperature": 0.0, "top_k": 5}))
    live = LiveServer(path)
    try:
        assert live.ctx.processor.sampling_defaults == {"temperature": 0.0, "top_k": 5}
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 12, "ignore_eos": True}
        texts = [httpx.post(live.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                 for _ in range(2)]
        greedy = httpx.post(live.base_url + "/v1/completions", json={**body, "temperature": 0},
                            timeout=60).json()["choices"][0]["text"]
        assert texts[0] == texts[1] == greedy  # greedy from the model's default, not temperature 1
        sampled = {httpx.post(live.base_url + "/v1/completions", json={**body, "temperature": 1.5, "seed": s},
                              timeout=60).json()["choices"][0]["text"] for s in range(4)}
        assert len(sampled) > 1  # a field given keeps its value
        assert live.wait_idle()["kv_blocks_used"] == 0
    finally:
        live.stop()
