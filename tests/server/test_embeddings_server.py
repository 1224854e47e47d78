"""POST /v1/embeddings through the official openai client on a --runner pooling server: float and base64 (the
client's default, decoded by it), text and token-id inputs, usage, dimensions refused or applied (a Matryoshka
config.json), the vectors equal to HF AutoModel's pooled hidden states; and the wrong runner's routes a 400."""
from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

import httpx  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from .conftest import MODEL_NAME, LiveServer  # noqa: E402

TEXTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog."]
_ST = "sentence_transformers.models."


@pytest.fixture(scope="module")
def pooling_models(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The server's tiny weights with a sentence-transformers config (mean + Normalize), and as they are with a
    Matryoshka config.json (last token, normalised: the default)."""
    root = tmp_path_factory.mktemp("embed-server")
    mean = Path(shutil.copytree(tiny_model, root / "mean"))
    (mean / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": _ST + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": _ST + "Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": _ST + "Normalize"}]))
    (mean / "1_Pooling").mkdir()
    (mean / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    matryoshka = Path(shutil.copytree(tiny_model, root / "matryoshka"))
    config = json.loads((matryoshka / "config.json").read_text())
    (matryoshka / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return {"mean": mean, "matryoshka": matryoshka}


@pytest.fixture(scope="module")
def servers(pooling_models: dict[str, Path]) -> Iterator[dict[str, LiveServer]]:
    live = {name: LiveServer(path, runner="pooling", max_num_batched_tokens=64)
            for name, path in pooling_models.items()}
    yield live
    for server in live.values():
        server.stop()


def _client(server: LiveServer) -> Any:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(tiny_model: Path) -> tuple[Any, Any]:
    model = transformers.AutoModel.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(tiny_model))


def _states(hf: tuple[Any, Any], ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf[0](torch.tensor([ids])).last_hidden_state[0]


def _assert_close(ours: list[float], ref: torch.Tensor) -> None:
    vec = torch.tensor(ours)
    assert vec.shape == ref.shape and F.cosine_similarity(vec, ref, dim=0) >= 0.9999
    assert torch.allclose(vec, ref, rtol=1e-4, atol=1e-4)


def _assert_same(a: list[list[float]], b: list[list[float]]) -> None:
    """The same vectors up to float32 rounding: a batch of other prompts sums in another order."""
    assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6)


def test_float_base64_and_token_ids(servers, hf):
    client, tok = _client(servers["mean"]), hf[1]
    ids = [tok.encode(t) for t in TEXTS]
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == MODEL_NAME and [d.index for d in floats.data] == [0, 1]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    for d, prompt in zip(floats.data, ids):
        assert d.object == "embedding"
        _assert_close(d.embedding, F.normalize(_states(hf, prompt).mean(0), dim=-1))
    default = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the client asks for base64, decodes it
    _assert_same([d.embedding for d in default.data], [d.embedding for d in floats.data])
    raw = httpx.post(servers["mean"].base_url + "/v1/embeddings", timeout=60,
                     json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    assert isinstance(raw["data"][0]["embedding"], str)
    decoded = torch.frombuffer(bytearray(base64.b64decode(raw["data"][0]["embedding"])), dtype=torch.float32)
    _assert_same([decoded.tolist()], [floats.data[0].embedding])
    by_ids = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float")
    one = client.embeddings.create(model=MODEL_NAME, input=ids[0], encoding_format="float")
    _assert_same([d.embedding for d in by_ids.data] + [one.data[0].embedding],
                 [d.embedding for d in floats.data] + [floats.data[0].embedding])
    assert one.usage.prompt_tokens == len(ids[0])


def test_dimensions_refused_or_applied(servers, hf):
    with pytest.raises(openai.BadRequestError) as refused:
        _client(servers["mean"]).embeddings.create(model=MODEL_NAME, input=TEXTS[0], dimensions=16)
    assert refused.value.body["param"] == "dimensions" and "Matryoshka" in refused.value.body["message"]
    client = _client(servers["matryoshka"])
    cut = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], dimensions=16, encoding_format="float")
    states = _states(hf, hf[1].encode(TEXTS[0]))
    _assert_close(cut.data[0].embedding, F.normalize(states[-1][:16], dim=-1))  # last token, cut, normalised
    with pytest.raises(openai.BadRequestError, match="at most the model's 64"):
        client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], dimensions=65)


def test_bad_inputs_and_the_wrong_runner(servers, server):
    client = _client(servers["mean"])
    with pytest.raises(openai.BadRequestError, match="--runner pooling: it serves /v1/embeddings"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.completions.create(model=MODEL_NAME, prompt="def f", max_tokens=2, stream=True)
    with pytest.raises(openai.BadRequestError, match="the prompt is empty"):
        client.embeddings.create(model=MODEL_NAME, input="")
    with pytest.raises(openai.BadRequestError, match=r"input\[1\]: prompt token ids must be in \[0, 320\)"):
        client.embeddings.create(model=MODEL_NAME, input=[[5, 6], [5, 999]])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")
    with pytest.raises(openai.BadRequestError, match="needs a server started with --runner pooling"):
        _client(server).embeddings.create(model=MODEL_NAME, input="def f")  # the shared server generates
    bad = httpx.post(servers["mean"].base_url + "/v1/embeddings", json={"input": "x", "encoding_format": "int8"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "encoding_format"
    for live in servers.values():
        stats = live.wait_idle()
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
